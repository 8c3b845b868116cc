"""Which ranks share a copy of ``local_dir`` (a machine's ``/dev/shm`` is its own), and whose
local checkpoints a copy may hold.

Each copy of the directory carries an id, made by the first process that sees it; ranks that
report the same id share one copy, and the lowest of them (the copy's *keeper*) acts for it. A
copy also names the job whose checkpoints it holds: a copy left by an earlier job, or by
nothing of this one, is cleared before anything is read from it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from attrs import frozen

ID_FILE, JOB_FILE = "copy-id", "job"


def copy_id(directory: Path) -> str:
    """The id of the copy of ``directory`` this process sees, made here when it has none yet.
    A draft is linked into place, so a process never reads a half-written id."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ID_FILE
    if not path.exists():
        draft = directory / f".{ID_FILE}-{os.getpid()}-{uuid.uuid4().hex}"
        draft.write_text(uuid.uuid4().hex)
        try:
            os.link(draft, path)
        except FileExistsError:
            pass  # another process of this machine was first
        finally:
            draft.unlink()
    return path.read_text()


def job_of(directory: Path) -> str:
    """The job whose checkpoints this copy holds ("" for none)."""
    path = directory / JOB_FILE
    return path.read_text() if path.exists() else ""


def claim(directory: Path, job: str) -> None:
    """This copy now holds ``job``'s checkpoints only: anything else in it goes first."""
    for entry in directory.iterdir():
        if entry.name != ID_FILE and not entry.name.startswith(f".{ID_FILE}-"):
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    (directory / JOB_FILE).write_text(job)


@frozen
class Copies:
    """The copies of ``local_dir`` this job's ranks see: one keeper rank for each."""

    keepers: list[int]
    """The lowest rank seeing each copy, by rank."""
    mine: int | None
    """This rank's index in ``keepers`` when it keeps its copy; None otherwise."""
    group: Any = None
    """A gloo group of the keepers, when there are several copies (None otherwise)."""

    @property
    def several(self) -> bool:
        return len(self.keepers) > 1


def find_copies(directory: Path, rank: int, world_size: int, new_job: bool) -> tuple[Copies, str]:
    """Every rank's copy of ``directory`` and the job it holds, gathered (one small all-gather);
    returns the copies and this job's id: a new one when rank 0 starts a new job, else the one
    rank 0's copy (or, lacking one, the lowest rank's) holds."""
    own = (copy_id(directory), job_of(directory), new_job, uuid.uuid4().hex)  # (rank 0's fresh id is the one used)
    seen: list[Any] = [own]
    if world_size > 1:
        seen = [None] * world_size
        torch.distributed.all_gather_object(seen, own)
    first_seen = {copy: r for r, (copy, *_) in reversed(list(enumerate(seen)))}
    keepers = sorted(first_seen.values())
    held = [job for _, job, *_ in seen if job]
    _, rank_0s_job, starts_anew, fresh = seen[0]
    job = fresh if starts_anew or not held else (rank_0s_job or held[0])
    group = None
    if len(keepers) > 1:  # every rank takes part in making a group, members or not
        group = torch.distributed.new_group(keepers, backend="gloo")
    mine = keepers.index(rank) if rank in keepers else None
    return Copies(keepers, mine, group), job
