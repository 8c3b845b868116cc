"""``local-checkpoint``: a checkpoint in host memory every few steps, so a restart loses at most
those steps, not everything since the last durable save (Megatron's non-persistent checkpoints).

    [plugins.local-checkpoint]
    local_save_interval = 1          # steps between local checkpoints
    local_dir = "/dev/shm"           # default: /dev/shm (host memory) where there is one, else the temp dir

Every ``local_save_interval`` steps it asks the core for a non-persistent checkpoint
(``Control.request_checkpoint(persistent=False)``): the same files as a durable one (model,
optimizer, schedule, data position, random streams, plugins' states), written at once into
``local_dir/coretrain-<run>/`` where only the newest is kept. A resume — after an in-process
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
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from attrs import define, field

from coretrain import Every, Outcome, Run, StepOutputs, UserError, hookimpl, max_over_ranks, positive
from coretrain_local_checkpoint.machines import Copies, claim, find_copies, job_of
from coretrain_local_checkpoint.sharing import place_for_resume, replicate


def default_dir() -> str:
    """Host memory where the OS offers it as a file system, else the temp directory."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


@define(kw_only=True)
class LocalCheckpoint:
    """A non-persistent checkpoint every ``local_save_interval`` steps, for fast restarts."""

    local_save_interval: int = field(default=1, validator=positive)
    """Steps between local checkpoints: a restart loses at most this many."""
    local_dir: str = field(factory=default_dir)
    """Where they go (a folder per run inside): host memory (``/dev/shm``) or a fast local disk."""
    _builds: int = field(default=0, init=False, repr=False)
    _copies: Copies = field(factory=lambda: Copies([0], 0), init=False, repr=False)

    def directory(self, run: Run) -> Path:
        """This run's folder: one per output directory, so runs beside each other never share one."""
        key = hashlib.sha1(str(run.output_dir.resolve()).encode()).hexdigest()[:12]
        return Path(self.local_dir).absolute() / f"coretrain-{key}"

    @hookimpl
    def configure_run(self, run: Run) -> None:
        if not run.config.checkpoint.save:
            raise UserError("plugins.local-checkpoint: checkpoint.save is false, so nothing is saved; turn it on")
        directory = self.directory(run)
        new_job = self._builds == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        new_job = new_job and "CORETRAIN_REPLACEMENT" not in os.environ  # (a process in place of one that died)
        self._builds += 1
        self._copies, job = find_copies(directory, run.dist.rank, run.dist.world_size, new_job)
        if self._copies.mine is not None and job_of(directory) != job:  # an earlier job's, or none
            claim(directory, job)
        max_over_ranks(0)  # every copy is this job's
        if self._copies.several and self._copies.mine is not None:
            place_for_resume(self._copies, directory)
        max_over_ranks(0)  # every machine holds the same local checkpoints
        run.control.non_persistent_dir = str(directory)

    @hookimpl
    def pre_step(self, run: Run, step: int) -> None:
        """The local save of the step before, copied to every machine (when there are several).
        Decided by the step alone, so every machine's keeper decides alike — also a rank that
        joined after the step before (state kept from an earlier build would not be)."""
        if Every(self.local_save_interval)(step - 1) and self._copies.several and self._copies.mine is not None:
            replicate(self._copies, self.directory(run))

    @hookimpl
    def post_step(self, run: Run, step: int, outputs: StepOutputs) -> None:
        if Every(self.local_save_interval)(step):
            run.control.request_checkpoint(persistent=False)

    @hookimpl
    def on_train_end(self, run: Run, outcome: Outcome) -> None:
        """A run that ended well needs no restart: its local checkpoints go (a failed one keeps
        them for the restart that may follow)."""
        if outcome != "error" and self._copies.mine is not None:
            shutil.rmtree(self.directory(run), ignore_errors=True)
