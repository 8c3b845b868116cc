"""Committing a ``PREFIX.bin/.idx`` pair at once: a reader sees the previous pair or the new one,
never the new ``.bin`` beside the old ``.idx``, whenever the writer is killed.

Two files cannot be renamed in one step, so the pair's names go through one link that can:

    PREFIX.bin -> .NAME.pair/bin          (made once; NAME is PREFIX's file name)
    PREFIX.idx -> .NAME.pair/idx
    .NAME.pair -> .NAME.3                 (replaced atomically by each commit)
    .NAME.3/bin, .NAME.3/idx              (the files themselves)

A commit writes ``.NAME.<n+1>/``, points ``.NAME.pair`` at it in one rename, then removes the
previous version. Megatron's reader and any tool follow the links; a directory copied with
``cp -r`` or ``rsync -a`` keeps them (they are relative). A pair that is two plain files (an
older coretrain's, or Megatron's ``preprocess_data.py``'s) is moved under the link first,
each step leaving the previous pair readable.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

SUFFIXES = ("bin", "idx")


def pair_dir(prefix: Path) -> Path:
    """The link the pair's names go through."""
    return prefix.parent / f".{prefix.name}.pair"


def versions(prefix: Path) -> dict[int, Path]:
    """The version directories of the pair (committed or left by a writer that was killed)."""
    stem = f".{prefix.name}."
    found = {}
    for path in prefix.parent.iterdir():
        number = path.name[len(stem) :]
        if path.name.startswith(stem) and number.isdigit() and path.is_dir() and not path.is_symlink():
            found[int(number)] = path
    return found


def new_version(prefix: Path) -> Path:
    """A fresh directory for the next version of the pair's files."""
    directory = prefix.parent / f".{prefix.name}.{max(versions(prefix), default=0) + 1}"
    directory.mkdir()
    return directory


def commit(prefix: Path, version: Path) -> None:
    """Make ``version``'s ``bin`` and ``idx`` the pair at ``PREFIX.bin/.idx``, in one rename."""
    for name in SUFFIXES:
        fsync(version / name)
    fsync(version)
    link = pair_dir(prefix)
    _adopt_plain_pair(prefix, link)
    _point(link, version.name)
    for name in SUFFIXES:  # once made, these never change
        _point(prefix.parent / f"{prefix.name}.{name}", f"{link.name}/{name}")
    fsync(prefix.parent)
    for old in versions(prefix).values():  # the previous one, and any a killed writer left
        if old != version:
            shutil.rmtree(old, ignore_errors=True)


def current(prefix: Path) -> Path | None:
    """The version directory the pair's link points at (None: no committed version of ours)."""
    link = pair_dir(prefix)
    if not link.is_symlink():
        return None
    target = link.parent / os.readlink(link)
    return target if target.parent == link.parent else None


def _adopt_plain_pair(prefix: Path, link: Path) -> None:
    """Plain ``PREFIX.bin/.idx`` files become version 0 behind the link (hard links: no copy),
    so the names can turn into links one at a time while still reading the same pair."""
    plain = [prefix.parent / f"{prefix.name}.{name}" for name in SUFFIXES]
    if not all(path.is_file() and not path.is_symlink() for path in plain):
        return
    adopted = prefix.parent / f".{prefix.name}.0"
    shutil.rmtree(adopted, ignore_errors=True)
    adopted.mkdir()
    for path, name in zip(plain, SUFFIXES):
        os.link(path, adopted / name)
    _point(link, adopted.name)
    for path, name in zip(plain, SUFFIXES):
        _point(path, f"{link.name}/{name}")


def _point(path: Path, target: str) -> None:
    """``path`` becomes a link to ``target``, in one rename (a reader sees the old or the new)."""
    if path.is_symlink() and os.readlink(path) == target:
        return
    temporary = path.with_name(f"{path.name}.{os.getpid()}.link")
    temporary.unlink(missing_ok=True)
    os.symlink(target, temporary)
    os.replace(temporary, path)


def fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
