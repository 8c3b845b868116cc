"""Save and restore a run: one directory per step, committed by an atomic rename.

Layout under ``<output_dir>/checkpoints/``::

    step_00000100/          complete: the rename from its temporary name is the commit
        model.pt            rank 0: model state_dict
        optimizer.pt        rank 0: optimizer + LR schedule state
        rank_00000.pt       every rank: train state, RNG, plugin states
    step_00000200.tmp/      an interrupted save: never loaded
    latest                  text: the newest committed step (a hint; the directories decide)

Everything is loaded with ``weights_only=True``: RNG and plugin states are plain tensors,
numbers, strings, lists and dicts, so no arbitrary object is ever unpickled.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coretrain.errors import UserError
from coretrain.run import Run, TrainState

STEP_DIR = re.compile(r"^step_(\d{8})$")


def checkpoint_root(run: Run) -> Path:
    return run.output_dir / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def complete_steps(root: Path) -> list[int]:
    """Steps with a committed checkpoint, oldest first."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := STEP_DIR.match(p.name)))


def rng_state() -> dict[str, Any]:
    """Every generator a run may draw from, as plain lists and tensors (weights_only-safe)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state(),
                             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(run: Run, extra_state: dict[str, Any]) -> Path:
    """Write the checkpoint of ``run.state.step`` and commit it; returns its directory.

    ``extra_state`` carries what the loop keeps outside ``run`` (pending log values) and the
    plugins' states collected through ``on_checkpoint``.
    """
    root = checkpoint_root(run)
    final = step_dir(root, run.state.step)
    tmp = final.with_name(final.name + ".tmp")
    if run.dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        _save_file(run.model.state_dict(), tmp / "model.pt")
        _save_file({"optimizer": run.optimizer.state_dict(), "scheduler": run.scheduler.state_dict()},
                   tmp / "optimizer.pt")
    _barrier()
    state = {"train": {"step": run.state.step, "consumed_samples": run.state.consumed_samples,
                       "skipped_updates": run.state.skipped_updates},
             "rng": rng_state(), **extra_state}
    _save_file(state, tmp / f"rank_{run.dist.rank:05d}.pt")
    _barrier()
    if run.dist.is_main:
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        (root / "latest.tmp").write_text(f"{run.state.step}\n")
        os.replace(root / "latest.tmp", root / "latest")
        _apply_retention(root, run.config.checkpoint.keep_last)
    _barrier()
    return final


def _apply_retention(root: Path, keep_last: int | None) -> None:
    if not keep_last:
        return
    for step in complete_steps(root)[:-keep_last]:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def _load_file(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"{path}: checkpoint file missing; the checkpoint is incomplete") from None
    except Exception as exc:  # truncated zip, bad pickle, foreign object: name the file
        raise UserError(f"{path}: cannot load checkpoint file ({type(exc).__name__}: {exc})") from None


def find_resume_dir(run: Run) -> Path | None:
    """The checkpoint ``checkpoint.resume`` asks for: newest complete one, an explicit path, or none."""
    choice = run.config.checkpoint.resume
    if choice == "never":
        return None
    if choice != "auto":
        path = Path(choice)
        if not path.is_dir() or not STEP_DIR.match(path.name):
            raise UserError(f"checkpoint.resume: '{choice}' is not a checkpoint directory (step_NNNNNNNN)")
        return path
    steps = complete_steps(checkpoint_root(run))
    return step_dir(checkpoint_root(run), steps[-1]) if steps else None


def load(run: Run, path: Path) -> dict[str, Any]:
    """Restore model, optimizer, schedule, counters and RNG from ``path``; return the rank state."""
    run.model.load_state_dict(_load_file(path / "model.pt"))
    optim = _load_file(path / "optimizer.pt")
    run.optimizer.load_state_dict(optim["optimizer"])
    run.scheduler.load_state_dict(optim["scheduler"])
    state = _load_file(path / f"rank_{run.dist.rank:05d}.pt")
    run.state = TrainState(**state["train"])
    set_rng_state(state["rng"])
    return state


def load_pretrained(run: Run, path: str) -> None:
    """Model weights only (fine-tuning): step 0, fresh optimizer."""
    directory = Path(path)
    run.model.load_state_dict(_load_file(directory / "model.pt" if directory.is_dir() else directory))
