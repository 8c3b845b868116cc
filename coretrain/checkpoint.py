"""Save and restore a run: one directory per step, committed by an atomic rename.

Layout under ``<output_dir>/checkpoints/``::

    step_00000100/          complete: the rename from its temporary name is the commit
        model.pt            rank 0: model state_dict          } replicated models
        optimizer.pt        rank 0: optimizer state_dict      }
        sharded/            every rank's shards of model + optimizer, written by
                            torch.distributed.checkpoint (FSDP2); .metadata last
        rank_00000.pt       every rank: train state, LR schedule, grad scaler, RNG, plugin states
        checkpoint.json     rank 0: the manifest (layout, world size, optimizer, seq_length,
                            whether validation at this step was logged, the resolved config)
    step_00000200.tmp/      an interrupted save: never loaded
    latest                  text: the newest committed step (a hint; the directories decide)

Saving is synchronous, or with ``checkpoint.async_save`` the training thread only copies the
state to host memory and a background thread writes, fsyncs and commits (:class:`Checkpointer`).
Every file is read through :mod:`coretrain.safeload` (torch's ``weights_only`` unpickler, a
restricted unpickler for DCP's ``.metadata``), and the sharded reader is used only for a
checkpoint whose manifest says it was written sharded: nothing in a checkpoint is ever run.
Reading (:func:`read`) is separate from applying (:func:`apply`), so a resume can fall back
past a corrupt checkpoint without having changed the run.
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
from coretrain.errors import CheckpointUnreadable, RunFailure, UserError
from coretrain.run import Run, TrainState

log = logging.getLogger("coretrain")

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


class _WriteErrors:
    """A file object that remembers the OSError of a failed write (torch.save reports only a
    RuntimeError about the stream position, which hides a full disk)."""

    def __init__(self, file: Any) -> None:
        self.file, self.error = file, None

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
        self._buffers: dict[tuple, torch.Tensor] = {}

    def copy(self, obj: Any, path: tuple = (), memo: dict[int, torch.Tensor] | None = None) -> Any:
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


def collect(run: Run, extra_state: dict[str, Any], validated: bool = False) -> dict[str, Any]:
    """This rank's files of the checkpoint: file name -> object to save."""
    state = {"train": {"step": run.state.step, "consumed_samples": run.state.consumed_samples,
                       "skipped_updates": run.state.skipped_updates},
             "scheduler": run.scheduler.state_dict(), "rng": rng_state(), **extra_state}
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
        files[MANIFEST] = manifest(run, "sharded" if sharded else "replicated", validated)
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
            import torch.distributed.checkpoint as dcp

            dcp.save(obj.state, checkpoint_id=str(tmp / name))
        elif name.endswith(".json"):
            _write_json_atomically(tmp / name, obj)
        else:
            _save_file(obj, tmp / name)


def write_failure(root: Path, step: int, tmp: Path, exc: BaseException) -> RunFailure:
    """A save that could not be written (full disk, quota, permissions): one line, the old ones kept."""
    cause = safeload.first_failure(exc)  # DCP's CheckpointException wraps every rank's error
    detail = f"{cause.strerror}: {cause.filename or tmp}" if isinstance(cause, OSError) and cause.strerror \
        else f"{type(cause).__name__}: {cause}"
    shutil.rmtree(tmp, ignore_errors=True)  # free what the failed save took
    kept = complete_steps(root)
    previous = f"the newest complete checkpoint (step {kept[-1]}) is untouched" if kept else "no earlier checkpoint exists"
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


def write_and_commit(root: Path, step: int, files: dict[str, Any], is_main: bool, keep_last: int | None,
                     distributed: bool) -> Path:
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

    def save(self, extra_state: dict[str, Any], validated: bool = False) -> tuple[Path, float]:
        """Start (async) or do (sync) the save of the current step; returns (dir, seconds blocked)."""
        self.wait()
        run = self.run
        started = time.perf_counter()
        root, step, distributed = checkpoint_root(run), run.state.step, run.dist.world_size > 1
        files = collect(run, extra_state, validated)
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
            import torch.distributed.checkpoint as dcp

            future = dcp.async_save(sharded.state, checkpoint_id=str(tmp / "sharded"), process_group=self._group)
        staged = self._staging.copy(files)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking device-to-host copies must land first
        if distributed:
            _barrier()  # every rank's own file is written before anyone may commit
        self._pending_step = step
        self._thread = threading.Thread(target=self._finish, name=f"checkpoint-{step}", daemon=False,
                                        args=(root, step, tmp, staged, future))
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


def resume_candidates(run: Run) -> tuple[list[Path], bool]:
    """The checkpoints ``checkpoint.resume`` allows, newest first, and whether it named one explicitly."""
    choice = run.config.checkpoint.resume
    if choice == "never":
        return [], False
    if choice != "auto":
        path = Path(choice)
        if not path.is_dir() or not STEP_DIR.match(path.name):
            raise UserError(f"checkpoint.resume: '{choice}' is not a checkpoint directory (step_NNNNNNNN)")
        return [path], True
    root = checkpoint_root(run)
    steps = complete_steps(root)
    newest = steps[-1] if steps else -1
    for partial in sorted(root.glob("step_*.tmp")) if root.is_dir() else []:
        step = int(partial.name[5:13]) if partial.name[5:13].isdigit() else -1
        if step > newest:
            log.warning("ignoring incomplete checkpoint %s (its save never committed)", partial)
    return [step_dir(root, step) for step in reversed(steps)], False


MANIFEST = "checkpoint.json"
MANIFEST_FORMAT = 1


def manifest(run: Run, layout: str, validated: bool) -> dict[str, Any]:
    """What rank 0 records about a checkpoint, in plain JSON (read before any tensor file)."""
    from coretrain import __version__

    return {"format": MANIFEST_FORMAT, "coretrain": __version__, "step": run.state.step, "layout": layout,
            "world_size": run.dist.world_size, "optimizer": run.config.optimizer.name,
            "seq_length": run.datasets.seq_length if run.datasets else None, "validated": validated,
            "config": config_as_dict(run.config)}


def read_manifest(directory: Path) -> dict[str, Any]:
    """The checkpoint's manifest; one written before manifests existed is described from its files."""
    path = directory / MANIFEST
    if not path.exists():
        layout = "sharded" if (directory / "sharded").is_dir() and not (directory / "model.pt").exists() else "replicated"
        return {"layout": layout, "validated": False}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointUnreadable(path, f"cannot read the manifest: {type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict) or data.get("layout") not in ("sharded", "replicated") \
            or not isinstance(data.get("validated", False), bool) or not isinstance(data.get("config", {}), dict):
        raise CheckpointUnreadable(path, "not a coretrain checkpoint manifest (layout, validated, config)")
    return data


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def mark_validated(directory: Path) -> None:
    """Record that validation at this checkpoint's step ran and was logged (rank 0)."""
    data = read_manifest(directory)
    if (directory / MANIFEST).exists() and not data.get("validated"):
        _write_json_atomically(directory / MANIFEST, {**data, "validated": True})


def _load_sharded(run: Run, directory: Path, with_optimizer: bool) -> None:
    """Load a DCP checkpoint into the current model (sharded or not, any number of ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    safeload.check_metadata(directory)
    model_state, optimizer_state = get_state_dict(run.model, run.optimizer)
    state = {"model": model_state, "optimizer": optimizer_state} if with_optimizer else {"model": model_state}
    try:
        dcp.load(state, storage_reader=safeload.dcp_reader(directory), planner=safeload.dcp_planner(directory),
                 no_dist=run.dist.world_size == 1)
    except CheckpointUnreadable:
        raise
    except safeload.dcp_errors() as exc:  # DCP gathers every rank's failure: report ours, or the first
        raise safeload.dcp_unreadable(directory, exc) from None
    set_state_dict(run.model, run.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"] if with_optimizer else {})


def check_model_fits(directory: Path, saved: dict[str, Any], model: torch.nn.Module, hint: str = "") -> None:
    """One error naming the parameters whose names or shapes differ (a changed model config)."""
    current = model.state_dict()
    problems = [f"'{k}' is missing from the checkpoint" for k in current if k not in saved]
    problems += [f"'{k}' is in the checkpoint but not in the model" for k in saved if k not in current]
    problems += [f"'{k}' has shape {list(saved[k].shape)} in the checkpoint, {list(v.shape)} now"
                 for k, v in current.items() if k in saved and hasattr(saved[k], "shape") and saved[k].shape != v.shape]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UserError(f"{directory}: the checkpoint does not fit the model: {'; '.join(problems[:3])}{more}{hint}")


@attrs.define
class Restored:
    """What :func:`read` found in a checkpoint, before anything of the run is changed."""

    path: Path
    manifest: dict[str, Any]
    rank_state: dict[str, Any]
    model: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None


def read(run: Run, path: Path, with_optimizer: bool = True) -> Restored:
    """Read and check this rank's files of a checkpoint; changes nothing (so a caller may fall back)."""
    info = read_manifest(path)
    rank_file = path / f"rank_{run.dist.rank:05d}.pt"
    rank_state = safeload.load_file(rank_file)
    if not isinstance(rank_state, dict) or not isinstance(rank_state.get("train"), dict):
        raise CheckpointUnreadable(rank_file, "not a coretrain rank state (no 'train' table)")
    restored = Restored(path, info, rank_state)
    if info["layout"] == "replicated":
        restored.model = safeload.load_file(path / "model.pt")
        if with_optimizer:
            restored.optimizer = safeload.load_file(path / "optimizer.pt")
    else:  # DCP reads it again when applying; reading it here lets a crafted or torn one fail early
        safeload.check_metadata(path / "sharded")
    return restored


def apply(run: Run, restored: Restored, with_optimizer: bool = True) -> None:
    """Put a checkpoint read by :func:`read` into the run: model, optimizer, schedule, counters, RNG.

    The optimizer's hyperparameters (lr, betas, weight decay, per-group overrides) come from
    the config, not the checkpoint (Megatron's override_opt_param_scheduler): its moments and
    step counts are what resume needs; the settings are what the user asked for now.
    """
    path, state = restored.path, restored.rank_state
    hint = changed_keys_hint(restored.manifest.get("config"), run.config, ("model",))
    configured = [{k: v for k, v in group.items() if k != "params"} for group in run.optimizer.param_groups]
    if restored.manifest["layout"] == "sharded":
        try:
            _load_sharded(run, path / "sharded", with_optimizer=with_optimizer)
        except CheckpointUnreadable as exc:
            raise CheckpointUnreadable(exc.path, exc.reason + hint, unsafe=exc.unsafe) from None
    else:
        assert restored.model is not None
        check_model_fits(path, restored.model, run.unwrapped_model, hint)
        run.unwrapped_model.load_state_dict(restored.model)
        if with_optimizer:
            try:
                run.optimizer.load_state_dict(restored.optimizer)
            except (ValueError, KeyError, RuntimeError) as exc:
                raise UserError(f"{path / 'optimizer.pt'}: the optimizer state does not fit this optimizer ({exc}); "
                                "if its parameter groups changed, set checkpoint.load_optimizer = false") from None
    for group, settings in zip(run.optimizer.param_groups, configured):
        group.update(settings)
    run.scheduler.load_state_dict(state["scheduler"])
    if run.grad_scaler is not None and "grad_scaler" in state:
        run.grad_scaler.load_state_dict(state["grad_scaler"])
    run.state = TrainState(**state["train"])
    set_rng_state(state["rng"])


def read_newest_loadable(run: Run, candidates: list[Path], explicit: bool, with_optimizer: bool) -> Restored:
    """The newest of ``candidates`` every rank can read, falling back past corrupt ones.

    Every rank reads its part first and the ranks agree on the verdict, so all of them resume
    from the same step. A checkpoint named explicitly, or one whose file names code to run,
    is never skipped: its error stops the run. Nothing is deleted.
    """
    from coretrain.dist import max_over_ranks

    for tried, path in enumerate(candidates, start=1):
        problem: CheckpointUnreadable | None = None
        try:
            restored = read(run, path, with_optimizer)
        except CheckpointUnreadable as exc:
            problem = exc
        verdict = 0 if problem is None else 2 if problem.unsafe else 1
        if run.dist.world_size > 1:
            verdict = max_over_ranks(verdict)[0]
        if verdict == 0:
            return restored
        problem = problem or CheckpointUnreadable(path, "another rank could not read its part of it")
        if verdict == 2 or explicit or tried == len(candidates):
            raise problem
        log.warning("checkpoint %s is unusable: %s: %s; falling back to the previous complete checkpoint "
                    "(nothing is deleted)", path, problem.path, problem.reason)
    raise AssertionError("no candidates")  # callers pass at least one


def check_resumable(run: Run, info: dict[str, Any]) -> None:
    """Refuse what a resume cannot carry over; say which optimizer/scheduler settings change.

    The optimizer class and the sequence length are part of what the checkpoint means: a
    change is an error naming the keys. Optimizer and scheduler hyperparameters may change:
    the config's values are used from the first resumed step, and one warning lists them.
    """
    config, saved = run.config, info.get("config")
    saved_optimizer = info.get("optimizer")
    if saved_optimizer and saved_optimizer != config.optimizer.name and config.checkpoint.load_optimizer:
        raise UserError(f"optimizer.name: the checkpoint was trained with '{saved_optimizer}', the config asks for "
                        f"'{config.optimizer.name}'; its state cannot carry over: set checkpoint.load_optimizer = "
                        "false to start the optimizer afresh (weights, step and data position are kept)")
    saved_seq, seq = info.get("seq_length"), run.datasets.seq_length if run.datasets else None
    if saved_seq is not None and seq is not None and saved_seq != seq:
        hint = changed_keys_hint(saved, config, ("data", "model")) or "; the data provider reports it"
        raise UserError(f"seq_length is {seq} now and {saved_seq} in the checkpoint{hint}: the data position and "
                        "the model depend on it; resume with the old value or start a new run (another "
                        "run.output_dir, or checkpoint.resume = \"never\")")
    changed = [f"{key} {before!r} -> {after!r}" for key, before, after in config_changes(saved, config)
               if key.split(".")[0] in ("optimizer", "scheduler") and key != "optimizer.name"]
    if changed:
        log.warning("resuming with changed settings; the config's values are used from now on: %s", ", ".join(changed))


def changed_keys_hint(saved: dict[str, Any] | None, config: Any, sections: tuple[str, ...]) -> str:
    changed = [f"{key} ({before!r} -> {after!r})" for key, before, after in config_changes(saved, config)
               if key.split(".")[0] in sections]
    return f"; changed since the checkpoint: {', '.join(changed)}" if changed else ""


def config_changes(saved: dict[str, Any] | None, config: Any) -> list[tuple[str, Any, Any]]:
    """(dotted key, checkpoint's value, current value) for every leaf that differs."""
    if not saved:
        return []
    current = json.loads(json.dumps(config_as_dict(config)))  # tuples as lists, as the manifest has them
    changes: list[tuple[str, Any, Any]] = []

    def walk(before: Any, after: Any, prefix: str) -> None:
        if isinstance(before, dict) and isinstance(after, dict):
            for key in sorted(set(before) | set(after)):
                walk(before.get(key), after.get(key), f"{prefix}{key}.")
        elif before != after:
            changes.append((prefix.rstrip("."), before, after))

    walk(saved, current, "")
    return changes


def load_pretrained(run: Run, path: str) -> None:
    """Model weights only (fine-tuning): step 0, fresh optimizer."""
    directory = Path(path)
    if not directory.exists():
        raise UserError(f"checkpoint.pretrained: '{path}' does not exist")
    if directory.is_file():
        weights = safeload.load_file(directory)
    elif read_manifest(directory)["layout"] == "sharded":
        _load_sharded(run, directory / "sharded", with_optimizer=False)
        return
    else:
        weights = safeload.load_file(directory / "model.pt")
    if not isinstance(weights, dict):
        raise CheckpointUnreadable(directory, "not a state dict of model weights")
    check_model_fits(directory, weights, run.unwrapped_model)
    run.unwrapped_model.load_state_dict(weights)


def config_as_dict(config: Any) -> dict[str, Any]:
    from coretrain.configload import CONVERTER

    return CONVERTER.unstructure(config)


# --------------------------------------------------------------------------- inspecting and exporting


@attrs.define(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    complete: bool
    size_bytes: int


def list_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """Every checkpoint directory of a run, complete or not, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        raise UserError(f"{run_dir}: no checkpoints/ directory; is this a run's output dir?")
    found = []
    for path in root.iterdir():
        match = re.match(r"^step_(\d{8})(\.tmp)?$", path.name)
        if match and path.is_dir():
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            found.append(CheckpointInfo(int(match.group(1)), path, match.group(2) is None, size))
    return sorted(found, key=lambda c: (c.step, c.complete))


def export_weights(run_dir: Path, step: int | None, to: Path) -> Path:
    """Write the model weights of a complete checkpoint (newest by default) as safetensors."""
    from safetensors.torch import save_file

    if not to.parent.is_dir():
        raise UserError(f"--to: directory '{to.parent}' does not exist; create it first")
    if to.is_dir():
        raise UserError(f"--to: '{to}' is a directory; give a file name, e.g. {to / 'model.safetensors'}")
    complete = {c.step: c.path for c in list_checkpoints(run_dir) if c.complete}
    if not complete:
        raise UserError(f"{run_dir}: no complete checkpoint to export")
    if step is not None and step not in complete:
        raise UserError(f"--step {step}: no complete checkpoint at that step; complete: {sorted(complete)}")
    source = complete[step if step is not None else max(complete)]
    if read_manifest(source)["layout"] == "sharded":  # gather the shards into one state dict
        weights = read_sharded_model(source / "sharded")
    else:
        weights = safeload.load_file(source / "model.pt")
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise CheckpointUnreadable(source, "the model weights are not a dict of tensors")
    # tied parameters share storage; safetensors stores each name on its own
    try:
        save_file({name: tensor.contiguous().clone() for name, tensor in weights.items()}, str(to),
                  metadata={"format": "pt", "source": str(source)})
    except OSError as exc:
        raise RunFailure(f"cannot write {to}: {exc.strerror or exc}") from None
    return source


def read_sharded_model(directory: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a DCP checkpoint, in this one process, read safely."""
    # dcp.load fills a copy of the dict it is given; torch's own dcp_to_torch_save calls this instead
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    safeload.check_metadata(directory)
    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=safeload.dcp_reader(directory),
                         planner=safeload.dcp_planner(directory, empty=True), no_dist=True)
    except CheckpointUnreadable:
        raise
    except safeload.dcp_errors() as exc:
        raise safeload.dcp_unreadable(directory, exc) from None
    model = state.get("model")
    if not isinstance(model, dict):
        raise CheckpointUnreadable(directory, "no model state in the sharded checkpoint")
    return model
