"""Local checkpoints copied between machines: after each local save every machine's copy of
``local_dir`` gets the whole checkpoint (the files its own ranks wrote, linked; the rest sent by
a machine that has them), and before a resume every machine gets the newest checkpoint any
other holds — so a machine that takes a dead one's place resumes from the local tier too.

Files are moved as they are, not read as a checkpoint (any layout: replicated or sharded), over
a gloo group of one rank per machine, in pieces of at most 64 MiB.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from coretrain import step_dir, step_dirs
from coretrain_local_checkpoint.machines import Copies

log = logging.getLogger("coretrain")

COPIES = "copies"
"""Where a machine keeps the newest local checkpoint it holds whole (the core's own step
directories there hold only its ranks' files, except on rank 0's machine)."""
PIECE = 64 << 20


def step_name(step: int) -> str:
    return step_dir(Path(), step).name


def steps_in(directory: Path, committed: bool | None = None) -> list[int]:
    """The steps of the step directories in ``directory`` (``committed``: only those, or only
    the unfinished ``.tmp`` ones; None: both)."""
    return sorted({step for step, done, _ in step_dirs(directory) if committed is None or done == committed})


def holdings(directory: Path, step: int) -> dict[str, Path]:
    """Every file of ``step``'s checkpoint this machine has, by its path in the checkpoint."""
    found: dict[str, Path] = {}
    name = step_name(step)
    for source in (directory / COPIES / name, directory / name, directory / f"{name}.tmp"):
        if source.is_dir():
            for file in sorted(source.rglob("*")):
                if file.is_file():
                    found.setdefault(file.relative_to(source).as_posix(), file)
    return found


def gathered(copies: Copies, value: Any) -> list[Any]:
    """``value`` from every machine's keeper, in keeper order."""
    everyone: list[Any] = [None] * len(copies.keepers)
    torch.distributed.all_gather_object(everyone, value, group=copies.group)
    return everyone


def share(copies: Copies, directory: Path, step: int, target: Path) -> int:
    """Make ``target`` on every machine hold every file of ``step`` any machine has (keepers only,
    all of them). Returns the bytes the machines lacked."""
    mine = holdings(directory, step)
    listings = gathered(copies, {path: file.stat().st_size for path, file in mine.items()})
    staging = target.with_name(f".{target.name}.assembling")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    lacked = 0
    for path in sorted(set().union(*listings)):
        holders = [i for i, listing in enumerate(listings) if path in listing]
        into = staging / path
        into.parent.mkdir(parents=True, exist_ok=True)
        if path in mine:
            _link(mine[path], into)
        if len(holders) < len(listings):
            size = listings[holders[0]][path]
            lacked += size * (len(listings) - len(holders))
            _send(copies, holders[0], mine[path] if copies.mine == holders[0] else None, size, into)
    if target.exists():
        shutil.rmtree(target)
    os.replace(staging, target)
    return lacked


def _link(source: Path, into: Path) -> None:
    """The same file under another name (no second copy in memory); a copy across file systems."""
    try:
        os.link(source, into)
    except OSError:
        shutil.copy2(source, into)


def _send(copies: Copies, holder: int, source: Path | None, size: int, into: Path) -> None:
    """One file from the keeper ``holder`` to every other; those that lack it write it to ``into``."""
    receives = not into.exists()
    with open(source, "rb") if source else open(os.devnull, "rb") as reading:
        with open(into, "wb") if receives else open(os.devnull, "wb") as writing:
            for offset in range(0, size, PIECE):
                length = min(PIECE, size - offset)
                piece = torch.empty(length, dtype=torch.uint8)
                if source is not None:
                    reading.readinto(piece.numpy().data)
                torch.distributed.broadcast(piece, src=copies.keepers[holder], group=copies.group)
                if receives:
                    writing.write(piece.numpy().tobytes())
            if receives:
                writing.flush()
                os.fsync(writing.fileno())


def replicate(copies: Copies, directory: Path) -> None:
    """After a local save: every machine's ``copies/`` gets its newest committed step whole
    (keepers only). A step every machine already holds whole is not sent again."""
    newest = gathered(copies, (max(steps_in(directory, committed=True), default=-1), steps_in(directory / COPIES)))
    step = max(committed for committed, _ in newest)
    if step < 0 or all(step in held for _, held in newest):
        return
    share(copies, directory, step, directory / COPIES / step_name(step))
    for old in steps_in(directory / COPIES):
        if old < step:
            shutil.rmtree(directory / COPIES / step_name(old), ignore_errors=True)
    for written in steps_in(directory, committed=False):  # its ranks' files of a step now held whole
        if written <= step:
            shutil.rmtree(directory / f"{step_name(written)}.tmp", ignore_errors=True)


def place_for_resume(copies: Copies, directory: Path) -> None:
    """Before a resume (keepers only): every machine's ``local_dir`` gets the newest step any
    machine holds whole and, when newer, the newest any machine committed (a step saved but
    not yet copied: complete if its ranks' files survived, else the resume falls back past it)
    — and nothing else, so every rank chooses among the same local checkpoints."""
    seen = gathered(copies, (steps_in(directory / COPIES), steps_in(directory, committed=True)))
    whole = max((step for held, _ in seen for step in held), default=-1)
    committed = max((step for _, done in seen for step in done), default=-1)
    targets = sorted({step for step in (whole, committed) if step >= 0 and step >= whole})
    lacked = sum(share(copies, directory, step, directory / f".{step_name(step)}.placed") for step in targets)
    for _, _, path in step_dirs(directory):
        shutil.rmtree(path)
    for step in targets:
        os.replace(directory / f".{step_name(step)}.placed", directory / step_name(step))
    if targets and copies.mine == 0:
        log.info(
            "local checkpoints: step %s on each of %d machines (%s copied to machines that lacked it)",
            " and ".join(map(str, targets)),
            len(copies.keepers),
            in_words(lacked),
        )


def in_words(size: int) -> str:
    """A byte count as people read it: 340 kB, 12.5 GB."""
    scaled, unit = float(size), "B"
    for larger in ("kB", "MB", "GB", "TB", "PB"):
        if scaled < 1000:
            break
        scaled, unit = scaled / 1000, larger
    return f"{scaled:.3g} {unit}"
