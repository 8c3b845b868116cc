"""``local-checkpoint``: a checkpoint in host memory every few steps, so a restart loses at most
those steps, not everything since the last durable save (Megatron's non-persistent checkpoints).

    [plugins.local-checkpoint]
    local_save_interval = 1          # steps between local checkpoints
    local_dir = "/dev/shm"           # default: /dev/shm (host memory) where there is one, else the temp dir

Every ``local_save_interval`` steps it asks the core for a non-persistent checkpoint
(``Control.request_checkpoint(persistent=False)``), which the core writes into this plugin's
``checkpoint_target``: the same files as a durable one (model,
optimizer, schedule, data position, random streams, plugins' states), written at once into the run's
own folder in ``local_dir`` where only the newest is kept. A resume — after an in-process
restart (``inprocess-restart``) or a job restarted by its launcher (``torchrun
--max-restarts``) — takes the newest committed step of this tier and ``checkpoints/``. The
checkpoints at ``checkpoint.save_interval`` and at the end are durable as before; this tier is
gone when the run ends well, and a new job (a launcher's first attempt) clears what an earlier
one left, so it never resumes from another job's state.

On several machines each machine's ``local_dir`` is its own (``/dev/shm`` is): after each
local save every machine's copy gets the whole checkpoint — its own ranks' files linked, the
rest sent by a machine that has them — and before a resume every machine gets the newest one
any machine holds, so a machine that takes a dead one's place resumes from this tier as well
(Megatron's replicated local checkpoints, with every machine a replica). It costs a copy of the
state in host memory per machine (the model and optimizer's size, twice while a save commits)
and, on several machines, sending what the other machines' ranks wrote after each local save.

The folder is private (:mod:`coretrain_local_checkpoint.folder`): 0700, this user's, keyed by
the run's output directory; a symbolic link or another user's folder under its name is refused.
A local step whose manifest names another run is removed before a resume, which then takes the
durable checkpoint. ``local_dir`` is checked at start (absolute, an existing directory, room
for two checkpoints: without room local saves are off for the run, with a warning); a local save
that cannot be written is skipped on every rank with a warning, and training goes on.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from attrs import define, field

from coretrain import (
    Every,
    Outcome,
    Run,
    StepOutputs,
    UserError,
    config_as_dict,
    hookimpl,
    is_sharded,
    max_over_ranks,
    positive,
    read_manifest,
    step_dirs,
)
from coretrain_local_checkpoint.folder import (
    KEY,
    folder_name,
    make_private,
    private_folder,
    usable_local_dir,
)
from coretrain_local_checkpoint.machines import Copies, claim, find_copies, job_of
from coretrain_local_checkpoint.sharing import COPIES, in_words, place_for_resume, replicate

log = logging.getLogger("coretrain")


def default_dir() -> str:
    """Host memory where the OS offers it as a file system, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@define(kw_only=True)
class LocalCheckpoint:
    """A non-persistent checkpoint every ``local_save_interval`` steps, for fast restarts."""

    local_save_interval: int = field(default=1, validator=positive)
    """Steps between local checkpoints: a restart loses at most this many."""
    local_dir: str = field(factory=default_dir)
    """Where they go (an absolute path; a private folder per run inside): host memory (``/dev/shm``) or a fast
    local disk."""
    _builds: int = field(default=0, init=False, repr=False)
    _copies: Copies = field(factory=lambda: Copies([0], 0), init=False, repr=False)
    _directory: Path | None = field(default=None, init=False, repr=False)
    _off: bool = field(default=False, init=False, repr=False)
    """No room for local saves in this run (said at its start)."""

    def directory(self, run: Run) -> Path:
        """This run's folder (found by :meth:`configure_run`)."""
        assert self._directory is not None, "configure_run finds the folder"
        return self._directory

    @hookimpl
    def configure_run(self, run: Run) -> None:
        if not run.config.checkpoint.save:
            raise UserError("plugins.local-checkpoint: checkpoint.save is false, so nothing is saved; turn it on")
        self._directory = directory = _agreed(run, lambda: usable_local_dir(self.local_dir) / _rank_0s_name(run))
        _agreed(run, lambda: private_folder(directory))
        new_job = self._builds == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        new_job = new_job and "CORETRAIN_REPLACEMENT" not in os.environ  # (a process in place of one that died)
        self._builds += 1
        self._off = False
        self._copies, job = find_copies(directory, run.dist.rank, run.dist.world_size, new_job)
        if self._copies.mine is not None and job_of(directory) != job:  # an earlier job's, or none
            claim(directory, job)
        if self._copies.mine is not None:
            remove_other_runs_steps(run, directory)
        max_over_ranks(0)  # every copy is this job's, with this run's steps only
        if self._copies.several and self._copies.mine is not None:
            place_for_resume(self._copies, directory)
        if self._copies.mine is not None:
            make_private(directory)
        max_over_ranks(0)  # every machine holds the same local checkpoints

    @hookimpl
    def checkpoint_target(self, run: Run) -> str:
        """The core saves what this plugin asks for with ``persistent=False`` here, and resumes
        from the newest of this folder and ``checkpoints/``."""
        return str(self.directory(run))

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        """Room for a local save beside the one before it (the newest is kept until the next
        commits), on every rank's folder; agreed: without room anywhere, none asks for one."""
        need = 2 * bytes_to_save(run)
        free = shutil.disk_usage(self.directory(run)).free
        short = max_over_ranks(1 if free < need else 0)[0]
        self._off = bool(short)
        if free < need:
            log.warning(
                "%s: %s has %s free, a local checkpoint of this rank needs about %s (twice while one commits): "
                "local checkpoints are off for this run; durable checkpoints still protect it",
                KEY,
                self.directory(run).parent,
                in_words(free),
                in_words(need),
            )

    @hookimpl
    def pre_step(self, run: Run, step: int) -> None:
        """The local save of the step before, made private and copied to every machine (when
        there are several). Decided by the step alone, so every machine's keeper decides alike —
        also a rank that joined after the step before (state kept from an earlier build would not be)."""
        if not Every(self.local_save_interval)(step - 1) or self._copies.mine is None or self._off:
            return
        if self._copies.several:
            replicate(self._copies, self.directory(run))
        make_private(self.directory(run))

    @hookimpl
    def post_step(self, run: Run, step: int, outputs: StepOutputs) -> None:
        if Every(self.local_save_interval)(step) and not self._off:
            run.control.request_checkpoint(persistent=False)

    @hookimpl
    def on_train_end(self, run: Run, outcome: Outcome) -> None:
        """A run that ended well needs no restart: its local checkpoints go (a failed one keeps
        them for the restart that may follow)."""
        if outcome != "error" and self._copies.mine is not None:
            shutil.rmtree(self.directory(run), ignore_errors=True)
        elif self._copies.mine is not None:
            make_private(self.directory(run))

    @hookimpl
    def describe_checkpoints(self, run_dir: Path) -> list[str]:
        """``coretrain checkpoint list``: the run's folder on this host, when a job left it."""
        folder = Path(self.local_dir) / folder_name(run_dir)
        if not folder.is_dir() or folder.is_symlink():
            return []
        steps = sorted({step for root in (folder, folder / COPIES) for step, done, _ in step_dirs(root) if done})
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())
        return [
            f"local: {folder} holds step(s) {', '.join(map(str, steps)) or 'none'} ({in_words(size)}), left by a job "
            "that failed or is running; the run's next job resumes from it or clears it (remove it to free the space)"
        ]


def _rank_0s_name(run: Run) -> str:
    """The folder's name as rank 0 sees its output directory, on every rank."""
    names = [folder_name(run.output_dir) if run.dist.is_main else ""]
    if run.dist.world_size > 1:
        torch.distributed.broadcast_object_list(names, src=0)
    return str(names[0])


def _agreed(run: Run, check: Any) -> Any:
    """``check()`` on every rank; when it refuses on any, every rank stops (the refusing one with
    its message), instead of the others waiting for it in the next collective."""
    refusal: UserError | None = None
    try:
        result = check()
    except UserError as exc:
        refusal, result = exc, None
    refused_on = max_over_ranks(run.dist.rank + 1 if refusal else 0)[0]
    if refusal is not None:
        raise refusal
    if refused_on:
        raise UserError(f"{KEY}: refused on rank {refused_on - 1} (its error says why)")
    return result


def remove_other_runs_steps(run: Run, directory: Path) -> None:
    """Local steps whose manifest names another run (another output directory or name) are not
    this run's to resume: removed, so the resume takes ``checkpoints/``. (A machine's own steps
    hold only its ranks' files; the manifest is on rank 0's machine and in the whole copies.)"""
    ours = {key: config_as_dict(run.config)["run"][key] for key in ("output_dir", "name")}
    for root in (directory, directory / COPIES):
        for _, committed, path in step_dirs(root) if root.is_dir() else []:
            if not committed or not (path / "checkpoint.json").is_file():
                continue
            try:
                saved = read_manifest(path).get("config", {}).get("run", {})
            except Exception as exc:  # unreadable: the core's resume would fall back past it anyway
                log.debug("local checkpoint %s: %s", path, exc)
                continue
            theirs = {key: saved.get(key) for key in ours}
            if theirs != ours:
                log.warning(
                    "local checkpoint %s is another run's (its run.output_dir and run.name: %s; this run's: %s): "
                    "removed; the resume takes checkpoints/",
                    path,
                    theirs,
                    ours,
                )
                shutil.rmtree(path, ignore_errors=True)


def bytes_to_save(run: Run) -> int:
    """What this rank's machine holds of a checkpoint, roughly: the model state and the
    optimizer's (one not stepped yet counted as two moments per trainable parameter, as Adam's)
    — rank 0's whole, or every local rank's shards."""

    def size(tensors: Any) -> int:  # of this rank's part of each (a DTensor's local shard)
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in local)

    kept = [t for state in run.optimizer.state.values() for t in state.values()]
    optimizer = size(kept) or 2 * size(p for p in run.model.parameters() if p.requires_grad)
    if is_sharded(run.model):  # every rank writes its shards, into its machine's folder
        return (size(run.model.state_dict().values()) + optimizer) * int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return size(run.model.state_dict().values()) + optimizer if run.dist.is_main else 0
