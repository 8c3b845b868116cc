"""Save and restore a run: one directory per step, committed by an atomic rename.

Layout under ``<output_dir>/checkpoints/``::

    step_00000100/          complete: the rename from its temporary name is the commit
        model.pt            rank 0: model state_dict          } replicated models
        optimizer.pt        rank 0: optimizer state_dict      }
        sharded/            every rank's shards of model + optimizer, written by
                            torch.distributed.checkpoint (FSDP2); .metadata last
        rank_00000.pt       every rank: train state, LR schedule, grad scaler, RNG, plugin states
        checkpoint.json     rank 0: the manifest (layout, world size, optimizer, seq_length,
                            the splits evaluated and logged at this step, the resolved config)
    step_00000200.tmp/      an interrupted save: never loaded
    latest                  text: the newest committed step (a hint; the directories decide)

Saving is synchronous, or with ``checkpoint.async_save`` the training thread only copies the
state to host memory and a background thread writes, fsyncs and commits (:class:`Checkpointer`).
Resuming is :mod:`coretrain.resume`; listing and exporting :mod:`coretrain.export`. Both read
every file through :mod:`coretrain.safeload` (torch's ``weights_only`` unpickler, a restricted
unpickler for DCP's ``.metadata``) and use the sharded reader only for a checkpoint whose
manifest says it was written sharded: nothing in a checkpoint is ever run.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from coretrain import safeload
from coretrain.errors import CheckpointUnreadable, RunFailure
from coretrain.run import Run, config_as_dict

log = logging.getLogger("coretrain")

STEP_DIR = re.compile(r"^step_(\d{8})$")
MANIFEST = "checkpoint.json"
MANIFEST_FORMAT = 1


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
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
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


class _WriteErrors:
    """A file object that remembers the OSError of a failed write (torch.save reports only a
    RuntimeError about the stream position, which hides a full disk)."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self.file.write(data))
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


def _save_file(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        recorder = _WriteErrors(f)
        try:
            torch.save(obj, recorder)
        except Exception:
            if recorder.error is not None:
                raise OSError(recorder.error.errno, recorder.error.strerror, str(path)) from None
            raise
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HostStaging:
    """Host-memory copies of the state, in buffers kept from one save to the next.

    The first async save allocates them (and pays for first-touching the pages); later saves
    only copy into them, which is what keeps the training thread's share of an async save
    small. Buffers are pinned when the source lives on a GPU. Costs one host copy of the state
    for the life of the run, as torch.distributed.checkpoint's async staging does.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(self, obj: Any, path: tuple[Any, ...] = (), memo: dict[int, torch.Tensor] | None = None) -> Any:
        """A deep copy of ``obj`` whose tensors live in the staging buffers (sharing preserved)."""
        memo = {} if memo is None else memo
        if isinstance(obj, torch.Tensor):
            if id(obj) not in memo:
                buffer = self._buffers.get(path)
                if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                    buffer = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=obj.is_cuda)
                    self._buffers[path] = buffer
                buffer.copy_(obj.detach(), non_blocking=obj.is_cuda)
                memo[id(obj)] = buffer
            return memo[id(obj)]
        if isinstance(obj, dict):
            return {k: self.copy(v, (*path, k), memo) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.copy(v, (*path, i), memo) for i, v in enumerate(obj))
        return obj


@attrs.define
class ShardedState:
    """Model + optimizer state of a sharded (FSDP2) model: saved collectively with DCP."""

    state: dict[str, Any]


def is_sharded(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "full_tensor") for p in model.parameters())  # DTensor parameters


def collect(run: Run, extra_state: dict[str, Any], evaluated: list[str] | None = None) -> dict[str, Any]:
    """This rank's files of the checkpoint: file name -> object to save."""
    state = {
        "train": {
            "step": run.state.step,
            "consumed_samples": run.state.consumed_samples,
            "skipped_updates": run.state.skipped_updates,
        },
        "scheduler": run.scheduler.state_dict(),
        "rng": rng_state(),
        **extra_state,
    }
    if run.grad_scaler is not None:
        state["grad_scaler"] = run.grad_scaler.state_dict()
    files: dict[str, Any] = {f"rank_{run.dist.rank:05d}.pt": state}
    sharded = is_sharded(run.model)
    if sharded:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(run.model, run.optimizer)
        files["sharded"] = ShardedState({"model": model_state, "optimizer": optimizer_state})
    elif run.dist.is_main:
        files["model.pt"] = run.unwrapped_model.state_dict()
        files["optimizer.pt"] = run.optimizer.state_dict()
    if run.dist.is_main:
        files[MANIFEST] = manifest(run, "sharded" if sharded else "replicated", evaluated or [])
    return files


def _begin(root: Path, step: int, is_main: bool, distributed: bool) -> Path:
    """Rank 0 makes a fresh step_N.tmp; every rank returns it once it exists."""
    tmp = step_dir(root, step).with_name(f"step_{step:08d}.tmp")
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if distributed:
        _barrier()
    return tmp


def _write(tmp: Path, files: dict[str, Any]) -> None:
    for name, obj in files.items():
        if isinstance(obj, ShardedState):  # every rank writes its shards; .metadata comes last
            from torch.distributed.checkpoint.state_dict_saver import save

            save(obj.state, checkpoint_id=str(tmp / name))
        elif name.endswith(".json"):
            _write_json_atomically(tmp / name, obj)
        else:
            _save_file(obj, tmp / name)


def write_failure(root: Path, step: int, tmp: Path, exc: BaseException) -> RunFailure:
    """A save that could not be written (full disk, quota, permissions): one line, the old ones kept."""
    cause = safeload.first_failure(exc)  # DCP's CheckpointException wraps every rank's error
    detail = (
        f"{cause.strerror}: {cause.filename or tmp}"
        if isinstance(cause, OSError) and cause.strerror
        else f"{type(cause).__name__}: {cause}"
    )
    shutil.rmtree(tmp, ignore_errors=True)  # free what the failed save took
    kept = complete_steps(root)
    previous = (
        f"the newest complete checkpoint (step {kept[-1]}) is untouched" if kept else "no earlier checkpoint exists"
    )
    return RunFailure(f"checkpoint step {step}: cannot write ({detail}); {previous}")


def _commit(root: Path, step: int, tmp: Path, keep_last: int | None) -> None:
    """Rank 0, once every file is durable: fsync, rename (the commit), update latest, retention."""
    final = step_dir(root, step)
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    (root / "latest.tmp").write_text(f"{step}\n")
    os.replace(root / "latest.tmp", root / "latest")
    _apply_retention(root, keep_last)


def write_and_commit(
    root: Path, step: int, files: dict[str, Any], is_main: bool, keep_last: int | None, distributed: bool
) -> Path:
    """The synchronous save: write into step_N.tmp on every rank, then rank 0 commits."""
    tmp = _begin(root, step, is_main, distributed)
    try:
        _write(tmp, files)
    except safeload.dcp_errors() as exc:
        raise write_failure(root, step, tmp, exc) from exc
    if distributed:
        _barrier()
    if is_main:
        _commit(root, step, tmp, keep_last)
    if distributed:
        _barrier()
    return step_dir(root, step)


class Checkpointer:
    """Saves checkpoints synchronously, or asynchronously with ``checkpoint.async_save``.

    Async: the training thread writes the small per-rank file, copies the rest to host memory
    (reused staging buffers; for sharded models DCP's ``async_save`` stages its own) and
    returns; a background thread writes, waits for DCP, and on rank 0 commits. Every rank's
    small file is on disk before any background work starts, and DCP's coordinator writes
    ``.metadata`` only after every rank's shards, so rank 0 commits only a complete step.
    One save is in flight at a time; :meth:`wait` (before the next save and before the
    process leaves) finishes it and re-raises its error.
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self.asynchronous = run.config.checkpoint.async_save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending_step: int | None = None
        self._staging = HostStaging()
        self._group: Any = None
        if self.asynchronous and run.dist.world_size > 1:  # DCP's background collectives get their own group
            self._group = torch.distributed.new_group(backend="gloo")

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def save(self, extra_state: dict[str, Any], evaluated: list[str] | None = None) -> tuple[Path, float]:
        """Start (async) or do (sync) the save of the current step; returns (dir, seconds blocked)."""
        self.wait()
        run = self.run
        started = time.perf_counter()
        root, step, distributed = checkpoint_root(run), run.state.step, run.dist.world_size > 1
        files = collect(run, extra_state, evaluated)
        if not self.asynchronous:
            write_and_commit(root, step, files, run.dist.is_main, run.config.checkpoint.keep_last, distributed)
            return step_dir(root, step), time.perf_counter() - started

        tmp = _begin(root, step, run.dist.is_main, distributed)
        rank_file = f"rank_{run.dist.rank:05d}.pt"
        try:
            _write(tmp, {rank_file: files.pop(rank_file)})
        except safeload.dcp_errors() as exc:
            raise write_failure(root, step, tmp, exc) from exc
        sharded = files.pop("sharded", None)
        future = None
        if sharded is not None:
            from torch.distributed.checkpoint.state_dict_saver import async_save

            future = async_save(sharded.state, checkpoint_id=str(tmp / "sharded"), process_group=self._group)
        staged = self._staging.copy(files)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies must land first
        if distributed:
            _barrier()  # every rank's own file is written before anyone may commit
        self._pending_step = step
        self._thread = threading.Thread(
            target=self._finish, name=f"checkpoint-{step}", daemon=False, args=(root, step, tmp, staged, future)
        )
        self._thread.start()
        return step_dir(root, step), time.perf_counter() - started

    def _finish(self, root: Path, step: int, tmp: Path, staged: dict[str, Any], future: Any) -> None:
        try:
            _write(tmp, staged)
            if future is not None:
                future.result()
            if self.run.dist.is_main:
                _commit(root, step, tmp, self.run.config.checkpoint.keep_last)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = write_failure(root, step, tmp, exc) if isinstance(exc, safeload.dcp_errors()) else exc

    def done(self) -> int | None:
        """The step of an async save that has finished since the last call, if any (non-blocking)."""
        if self._thread is None or self._thread.is_alive():
            return None
        return self.wait()

    def wait(self) -> int | None:
        """Block until the save in flight is committed; returns its step."""
        if self._thread is None:
            return None
        self._thread.join()
        step, self._thread, self._pending_step = self._pending_step, None, None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return step


def _apply_retention(root: Path, keep_last: int | None) -> None:
    """Keep the newest ``keep_last`` complete checkpoints; the newest complete one always stays."""
    if not keep_last:
        return
    for step in complete_steps(root)[:-keep_last]:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def manifest(run: Run, layout: str, evaluated: list[str]) -> dict[str, Any]:
    """What rank 0 records about a checkpoint, in plain JSON (read before any tensor file)."""
    from coretrain import __version__

    return {
        "format": MANIFEST_FORMAT,
        "coretrain": __version__,
        "step": run.state.step,
        "layout": layout,
        "world_size": run.dist.world_size,
        "optimizer": run.config.optimizer.name,
        "seq_length": run.datasets.seq_length if run.datasets else None,
        "evaluated": evaluated,
        "config": config_as_dict(run.config),
    }


def read_manifest(directory: Path) -> dict[str, Any]:
    """The checkpoint's manifest; one written before manifests existed is described from its files."""
    path = directory / MANIFEST
    if not path.exists():
        layout = (
            "sharded" if (directory / "sharded").is_dir() and not (directory / "model.pt").exists() else "replicated"
        )
        return {"layout": layout, "evaluated": []}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointUnreadable(path, f"cannot read the manifest: {type(exc).__name__}: {exc}") from None
    if (
        not isinstance(data, dict)
        or data.get("layout") not in ("sharded", "replicated")
        or not isinstance(data.get("evaluated", []), list)
        or not isinstance(data.get("config", {}), dict)
    ):
        raise CheckpointUnreadable(path, "not a coretrain checkpoint manifest (layout, evaluated, config)")
    return data


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
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
        _write_json_atomically(directory / MANIFEST, {**data, "evaluated": sorted(splits)})
