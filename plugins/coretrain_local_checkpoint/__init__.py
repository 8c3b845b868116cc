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

Every rank must see the directory (one machine's ``/dev/shm`` does; on several machines name a
shared path): a job whose ranks do not is one error at start. It costs a copy of the state in
host memory per save (the model and optimizer's size, twice while a save commits).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from attrs import define, field

from coretrain import Every, Outcome, Run, StepOutputs, UserError, hookimpl, max_over_ranks, positive


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

    def directory(self, run: Run) -> Path:
        """This run's folder: one per output directory, so runs beside each other never share one."""
        key = hashlib.sha1(str(run.output_dir.resolve()).encode()).hexdigest()[:12]
        return Path(self.local_dir).absolute() / f"coretrain-{key}"

    @hookimpl
    def configure_run(self, run: Run) -> None:
        if not run.config.checkpoint.save:
            raise UserError("plugins.local-checkpoint: checkpoint.save is false, so nothing is saved; turn it on")
        directory = self.directory(run)
        first = self._builds == 0 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        first = first and "CORETRAIN_REPLACEMENT" not in os.environ  # (a process in place of one that died)
        self._builds += 1
        if run.dist.is_main:
            if first:  # a new job: what an earlier one left is not this job's state
                shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True, exist_ok=True)
        max_over_ranks(0)  # rank 0 has made it
        (unseen,) = max_over_ranks(int(not directory.is_dir()))
        if unseen:
            raise UserError(
                f"plugins.local-checkpoint: local_dir {self.local_dir!r} is not shared by every rank (a rank on "
                "another machine does not see what rank 0 made there); name a directory every rank sees"
            )
        run.control.non_persistent_dir = str(directory)

    @hookimpl
    def post_step(self, run: Run, step: int, outputs: StepOutputs) -> None:
        if Every(self.local_save_interval)(step):
            run.control.request_checkpoint(persistent=False)

    @hookimpl
    def on_train_end(self, run: Run, outcome: Outcome) -> None:
        """A run that ended well needs no restart: its local checkpoints go (a failed one keeps
        them for the restart that may follow)."""
        if outcome != "error" and run.dist.is_main:
            shutil.rmtree(self.directory(run), ignore_errors=True)
