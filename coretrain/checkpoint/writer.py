"""Writing a checkpoint: synchronously, or staged to host memory and written by a background thread."""

from __future__ import annotations

import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from coretrain.checkpoint import safeload
from coretrain.checkpoint.layout import begin, commit, failure_detail, step_dir, write_failure, write_json_atomically
from coretrain.checkpoint.state import ShardedState, collect
from coretrain.dist import max_over_ranks
from coretrain.pluginmanager import hook_calls
from coretrain.run import Run


class SkippedSave(Exception):
    """A save into a plugin's ``checkpoint_target`` that could not be written, on every rank (the run goes on);
    ``own``: this rank's write failed (the message is its cause), not only another's."""

    def __init__(self, message: str, own: bool) -> None:
        super().__init__(message)
        self.own = own


def checkpoint_root(run: Run) -> Path:
    return run.output_dir / "checkpoints"


def checkpoint_target(run: Run) -> Path | None:
    """A plugin's directory for this rank's non-persistent checkpoints (``checkpoint_target``)."""
    calls = hook_calls(run)
    target = calls.hook.checkpoint_target(run=run) if calls.implemented("checkpoint_target") else None
    if run.control.non_persistent_dir:  # hook API 1.12's way
        warnings.warn("run.control.non_persistent_dir is deprecated: answer checkpoint_target", DeprecationWarning, 2)
        target = target or run.control.non_persistent_dir
    return Path(target) if target else None


class _WriteErrors:
    """A file object that remembers the OSError of a failed write (torch.save reports only a
    RuntimeError about the stream position, which hides a full disk)."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        """The file's write; its first OSError is kept for :func:`_save_file` to raise."""
        try:
            return int(self.file.write(data))
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


def _save_file(obj: Any, path: Path) -> None:
    """``torch.save`` to a file that is on disk when this returns (fsync: the commit's rename
    must not outrun the data); a failed write raises the OSError that explains it."""
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


def write_files(tmp: Path, files: dict[str, Any]) -> None:
    """Each file of a save into ``tmp``: a sharded state through DCP (every rank its own shards),
    JSON atomically, the rest with ``torch.save``, fsynced."""
    for name, obj in files.items():
        if isinstance(obj, ShardedState):  # every rank writes its shards; .metadata comes last
            from torch.distributed.checkpoint import filesystem, state_dict_saver

            writer = filesystem.FileSystemWriter(tmp / name, thread_count=obj.writers)
            state_dict_saver.save(obj.state, storage_writer=writer)
        elif name.endswith(".json"):
            write_json_atomically(tmp / name, obj)
        else:
            _save_file(obj, tmp / name)


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

    def save(self, extra_state: dict[str, Any], evaluated: list[str], into: Path | None = None) -> tuple[Path, float]:
        """Start (async) or do (sync) the save of the current step; returns (dir, seconds blocked).
        ``into``: a plugin's ``checkpoint_target`` instead of ``checkpoints/``, written at once,
        only the newest kept; one that cannot be written is skipped (:class:`SkippedSave`) on
        every rank, since durable saves still protect the run."""
        self.wait()
        run = self.run
        started = time.perf_counter()
        root, step, distributed = into or checkpoint_root(run), run.state.step, run.dist.world_size > 1
        asynchronous = self.asynchronous and not into
        keep_last = 1 if into else run.config.checkpoint.keep_last
        # what retention keeps, asked on the training thread (plugins' hooks never run on the writer's)
        kept = hook_calls(run).protected_checkpoints(run=run, root=root) if run.dist.is_main and not into else set()
        files = collect(run, extra_state, evaluated)
        if into:
            tmp = self._write_or_skip(root, step, files)
        else:
            tmp = begin(root, step, run.dist.is_main, distributed)
            rank_file = f"rank_{run.dist.rank:05d}.pt"
            try:  # async: the small per-rank file now, the rest in the background
                write_files(tmp, {rank_file: files.pop(rank_file)} if asynchronous else files)
            except safeload.dcp_errors() as exc:
                raise write_failure(root, step, tmp, exc) from exc
            if distributed:  # every rank's own file is written before anyone may commit
                torch.distributed.barrier()
        if asynchronous:
            self._start_background(root, step, tmp, files, kept)
        elif run.dist.is_main:
            commit(root, step, tmp, keep_last, kept)
        if distributed and not asynchronous:
            torch.distributed.barrier()
        return step_dir(root, step), time.perf_counter() - started

    def _write_or_skip(self, root: Path, step: int, files: dict[str, Any]) -> Path:
        """The files of a save into a plugin's target, or — when any rank cannot write its part (a full or
        read-only ``/dev/shm``) — none: the ranks agree, the partial step goes, and every rank
        raises :class:`SkippedSave` with the first cause. The agreement is also the barrier
        before the commit."""
        run = self.run
        tmp = root / f"step_{step:08d}.tmp"
        failure: str | None = None
        try:
            begin(root, step, run.dist.is_main, run.dist.world_size > 1)
            write_files(tmp, files)
        except safeload.dcp_errors() as exc:
            failure = failure_detail(exc, tmp)
        failed_on = max_over_ranks(run.dist.rank + 1 if failure else 0)[0]  # the highest failing rank, + 1
        if failure is not None or failed_on:
            if run.dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise SkippedSave(failure or f"rank {failed_on - 1} could not write its part", own=failure is not None)
        return tmp

    def _start_background(self, root: Path, step: int, tmp: Path, files: dict[str, Any], kept: set[int]) -> None:
        """Stage the rest to host memory (DCP stages a sharded model's itself) and write it in a thread."""
        sharded = files.pop("sharded", None)
        future = None
        if sharded is not None:
            from torch.distributed.checkpoint import filesystem, state_dict_saver

            writer = filesystem.FileSystemWriter(tmp / "sharded", thread_count=sharded.writers)
            future = state_dict_saver.async_save(sharded.state, storage_writer=writer, process_group=self._group)
        staged = self._staging.copy(files)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies must land first
        self._pending_step = step
        self._thread = threading.Thread(
            target=self._finish, name=f"checkpoint-{step}", daemon=False, args=(root, step, tmp, staged, future, kept)
        )
        self._thread.start()

    def _finish(self, root: Path, step: int, tmp: Path, staged: dict[str, Any], future: Any, kept: set[int]) -> None:
        """The background thread: write the staged files, wait for DCP's shards, commit on rank 0.
        An error is kept for :meth:`wait` to raise on the training thread, where the run can act on it."""
        try:
            write_files(tmp, staged)
            if future is not None:
                future.result()
            if self.run.dist.is_main:
                commit(root, step, tmp, self.run.config.checkpoint.keep_last, kept)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = write_failure(root, step, tmp, exc) if isinstance(exc, safeload.dcp_errors()) else exc

    def done(self) -> int | None:
        """The step of an async save that has finished since the last call, if any (non-blocking)."""
        return None if self._thread is None or self._thread.is_alive() else self.wait()

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
