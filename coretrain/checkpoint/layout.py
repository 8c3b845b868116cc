"""Where a checkpoint lives and how it is committed: step directories, the manifest, retention.

A save writes into ``step_N.tmp/`` on every rank; rank 0 commits it with an atomic rename
once every file is durable. Everything that names or finds a step directory is here, once.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from coretrain.checkpoint import safeload
from coretrain.checkpoint.schema import MANIFEST as MANIFEST_SCHEMA
from coretrain.checkpoint.schema import validate
from coretrain.errors import CheckpointUnreadable, RunFailure, UserError

STEP_DIR = re.compile(r"^step_(\d{8})(\.tmp)?$")
MANIFEST = "checkpoint.json"
MANIFEST_FORMAT = 1

log = logging.getLogger("coretrain")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def parse_step_dir(name: str) -> tuple[int, bool] | None:
    """(step, committed) for a step directory's name; None for any other name."""
    match = STEP_DIR.match(name)
    return (int(match.group(1)), match.group(2) is None) if match else None


def step_dirs(root: Path) -> list[tuple[int, bool, Path]]:
    """Every step directory under ``root``, committed or not: (step, committed, path), by step."""
    if not root.is_dir():
        return []
    found = [(*parsed, p) for p in root.iterdir() if p.is_dir() and (parsed := parse_step_dir(p.name))]
    return sorted(found, key=lambda item: (item[0], item[1]))


def complete_steps(root: Path) -> list[int]:
    """Steps with a committed checkpoint, oldest first."""
    return [step for step, committed, _ in step_dirs(root) if committed]


def fsync_dir(path: Path) -> None:
    """Make a directory's entries durable: a rename is on disk only once its directory is synced."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def begin(root: Path, step: int, is_main: bool, distributed: bool) -> Path:
    """Rank 0 clears step_N.tmp; then every rank makes it (a machine's own ``checkpoint_target``
    is not rank 0's) and returns it."""
    tmp = root / f"step_{step:08d}.tmp"  # the save, until its commit
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if distributed:
        torch.distributed.barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def commit(root: Path, step: int, tmp: Path, keep_last: int | None, protected: set[int]) -> None:
    """Rank 0, once every file is durable: fsync, rename (the commit), update latest, retention."""
    final = step_dir(root, step)
    fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(root)
    (root / "latest.tmp").write_text(f"{step}\n")
    os.replace(root / "latest.tmp", root / "latest")
    apply_retention(root, keep_last, protected)


def apply_retention(root: Path, keep_last: int | None, protected: set[int]) -> None:
    """Keep the newest ``keep_last`` complete checkpoints and the ``protected`` ones (plugins'
    ``protected_checkpoints``); the newest complete one always stays."""
    if not keep_last:
        return
    for step in complete_steps(root)[:-keep_last]:
        if step not in protected:
            shutil.rmtree(step_dir(root, step), ignore_errors=True)


def linked_step(link: Path) -> int | None:
    """The step a named link beside the step directories points at (a plugin's, such as
    keep-best's ``best``): only a relative link to a committed step directory beside it (a link
    that leads anywhere else is not this run's, and is not followed)."""
    if not link.is_symlink():
        return None
    parsed = parse_step_dir(os.readlink(link))  # the whole target: a name, no path
    if parsed is None or not parsed[1]:  # not a committed step's name
        return None
    return parsed[0] if step_dir(link.parent, parsed[0]).is_dir() else None


def named_links(root: Path) -> dict[str, Path]:
    """The named links beside the step directories under ``root`` that lead to one, by name."""
    return {link.name: link for link in sorted(root.glob("*")) if linked_step(link) is not None}


def followed_link(path: Path, option: str) -> Path:
    """``path`` itself, the step directory a named link among the steps points at (never where
    an untrusted link leads), or the newest complete checkpoint of a run's output directory or of
    its ``checkpoints/`` (what a user names after a run: the run, not one of its steps)."""
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    if step_dirs(root):
        return find_checkpoint(root, None, option)
    if not path.is_symlink() or parse_step_dir(path.name) is not None:
        return path
    step = linked_step(path)
    if step is None:
        raise UserError(
            f"{option}: {path} -> {os.readlink(path)} is not a link to a step directory beside it; "
            "name the step directory itself"
        )
    return step_dir(path.parent, step)


def find_checkpoint(root: Path, which: int | str | None, option: str) -> Path:
    """A complete checkpoint under ``root``: at step ``which``, the one a named link beside the
    steps points at (a plugin's, such as ``best``), or the newest (None); a missing one is a
    UserError naming ``option``."""
    complete = complete_steps(root) if root.is_dir() else []
    if not complete:
        raise UserError(f"{option}: {root} holds no complete checkpoint")
    if isinstance(which, str) and not which.isdigit():
        name, which = which, linked_step(root / which)
        if which is None:
            raise UserError(
                f"{option} {name}: {root} has no '{name}' link to a complete step beside its checkpoints "
                "(a plugin writes such a link; is it on?)"
            )
    if which is not None and which not in complete:
        raise UserError(f"{option} {which}: no complete checkpoint at that step; complete: {complete}")
    return step_dir(root, complete[-1] if which is None else int(which))


def write_failure(root: Path, step: int, tmp: Path, exc: BaseException) -> RunFailure:
    """A save that could not be written (full disk, quota, permissions): one line, the old ones kept."""
    detail = failure_detail(exc, tmp)
    shutil.rmtree(tmp, ignore_errors=True)  # free what the failed save took
    kept = complete_steps(root)
    previous = (
        f"the newest complete checkpoint (step {kept[-1]}) is untouched" if kept else "no earlier checkpoint exists"
    )
    return RunFailure(f"checkpoint step {step}: cannot write ({detail}); {previous}")


def failure_detail(exc: BaseException, tmp: Path) -> str:
    """Why a save could not be written, in a phrase: ``No space left on device: FILE``."""
    cause = safeload.first_failure(exc)  # DCP's CheckpointException wraps every rank's error
    if isinstance(cause, OSError) and cause.strerror:
        return f"{cause.strerror}: {cause.filename or tmp}"
    return f"{type(cause).__name__}: {cause}"


def read_manifest(directory: Path) -> dict[str, Any]:
    """The checkpoint's manifest; one written before manifests existed is described from its files."""
    path = directory / MANIFEST
    if not path.exists():
        sharded = (directory / "sharded").is_dir() and not (directory / "model.pt").exists()
        return {"layout": "sharded" if sharded else "replicated", "evaluated": []}
    try:
        text = path.read_text(encoding="utf-8")
        depth = nesting(text)
        if depth > MAX_NESTING:  # a crafted file: the parser would recurse to the interpreter's limit
            raise ValueError(f"arrays or objects nested {depth} deep (at most {MAX_NESTING})")
        data = json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointUnreadable(path, f"cannot read the manifest: {type(exc).__name__}: {exc}") from None
    validate(data, MANIFEST_SCHEMA, path)
    return dict(data)


MAX_NESTING = 32
"""A manifest nests a few levels; the JSON parser recurses once per level, and near the
interpreter's recursion limit any finalizer or signal handler that runs fails with a traceback."""


def nesting(text: str) -> int:
    """How deep JSON ``text`` nests arrays and objects, counted without recursing."""
    unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', "", text)  # a string may hold brackets
    steps = [1 if bracket in "[{" else -1 for bracket in re.sub(r"[^\[\]{}]", "", unquoted)]
    return max(itertools.accumulate(steps), default=0)  # the deepest the running depth goes


def write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    """Written beside it and renamed over it: a reader sees the old file or the new, never half of one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def mark_evaluated(directory: Path, splits: list[str]) -> None:
    """Record which splits were evaluated (and logged) at this checkpoint's step (rank 0)."""
    data = read_manifest(directory)
    if (directory / MANIFEST).exists() and sorted(data.get("evaluated", [])) != sorted(splits):
        write_json_atomically(directory / MANIFEST, {**data, "evaluated": sorted(splits)})
