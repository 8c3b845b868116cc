"""``fault-injection``: make a rank misbehave on purpose, to test that runs survive it.

At a chosen step (or at random with a seeded probability per step), on chosen ranks, before
the step starts: ``hang`` (sleep until killed), ``raise`` (an exception, as a bug would),
``sigkill`` / ``sigterm`` / ``sigstop`` (the signal to this process), ``sleep`` (a slow rank; with
``every_step`` from that step on), or ``skip`` (veto that step's update, as a guard that saw a
bad loss on this rank alone would: the ranks agree, and every one skips it), or ``nan`` (the
step's loss comes out NaN on those ranks: its first forward only, a transient fault, or with
``persistent`` every forward of the step, its reruns too). Used by the straggler, signal,
restart, rerun and agreement tests.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from typing import Any, Literal

from attrs import define, field

from coretrain import FieldValueError, Run, UserError, hookimpl, in_range, non_negative, positive

log = logging.getLogger("coretrain")


def _env_int(name: str) -> int | None:
    return int(os.environ[name]) if name in os.environ else None


def _job_rank() -> int | None:
    """This process's rank in the job as started: torchrun's ``RANK``, and with torchft's replica
    groups (``REPLICA_GROUP_ID``, each group a job of ``WORLD_SIZE`` ranks) torchft's global rank."""
    rank, group = _env_int("RANK"), _env_int("REPLICA_GROUP_ID")
    if group is None:
        return rank
    return group * (_env_int("WORLD_SIZE") or 1) + (rank or 0)


def _attempt() -> int:
    """Which attempt this process is: the job's restarts, and this rank's replacements."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + int(os.environ.get("CORETRAIN_REPLACEMENT", "0"))


@define(kw_only=True)
class FaultInjection:
    """Hang, raise, SIGKILL, SIGTERM or sleep on chosen ranks at a chosen or random step."""

    action: Literal["hang", "raise", "sigkill", "sigterm", "sigstop", "sleep", "skip", "nan"]
    """What goes wrong (``sigstop``: the process freezes, as one stuck in the kernel does)."""
    step: int | None = field(default=None, validator=positive)
    """The step it happens at (before the step runs)."""
    probability: float = field(default=0.0, validator=in_range(0, 1))
    """Or: the chance per step, drawn from a generator seeded with seed + rank."""
    seed: int = 0
    """For probability: the generator's seed (plus the rank)."""
    ranks: list[int] = field(factory=list, validator=non_negative)
    """Ranks it happens on, as the processes were started (a process numbered anew after others
    left, ``--min-ranks``, keeps its first number here; with torchft's replica groups, the rank in
    the whole job: group × the group's ranks + its rank in the group); empty = every rank."""
    sleep_seconds: float = field(default=1.0, validator=non_negative)
    """For action = "sleep"."""
    every_step: bool = False
    """For action = "sleep": sleep on every step from ``step`` on, not once."""
    persistent: bool = False
    """For action = "nan": every forward of the step is NaN, its reruns' too (unset: the first)."""
    parameter: str | None = None
    """For action = "nan": the NaN goes into this parameter's gradient alone (a name from
    ``named_parameters()`` of the model as configured), not into the loss."""
    times: int | None = field(default=None, validator=positive)
    """At most this many times in this process; unset: once for a fault at ``step`` (the same
    step run again after an in-process restart does not fire again), every time it is due with
    ``probability`` or ``every_step``."""
    attempt: int | None = field(default=None, validator=non_negative)
    """Only in this attempt of the job (torchrun's ``TORCHELASTIC_RESTART_COUNT``: 0 is the first,
    1 the job restarted once; a process that replaced one that died adds how many times its rank
    was replaced, ``--replace-failed-ranks``); unset: in every attempt."""
    _fired: int = field(default=0, init=False, repr=False)
    _first_rank: int | None = field(factory=_job_rank, init=False, repr=False)
    _first_world: int | None = field(factory=lambda: _env_int("WORLD_SIZE"), init=False, repr=False)
    _rng: random.Random | None = field(default=None, init=False, repr=False)
    _veto_at: int | None = field(default=None, init=False, repr=False)
    _poison: Any = field(default=None, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.step is None and not self.probability:
            raise FieldValueError(
                "step", "set step (when it happens) or probability (a chance per step): with neither it never fires"
            )

    @hookimpl
    def configure_run(self, run: Run) -> None:
        """Ranks this job does not have would never fire (checked against the job as it started:
        a rank dropped later, ``--min-ranks``, keeps its number here)."""
        if "REPLICA_GROUP_ID" in os.environ:  # one of several groups: the job's ranks are more than this one's
            return
        started = max(self._first_world or 1, run.dist.world_size)
        missing = [rank for rank in self.ranks if rank >= started]
        if missing:
            raise UserError(
                f"plugins.fault-injection.ranks: {missing} are not ranks of this job ({run.dist.world_size} rank(s): "
                f"0..{run.dist.world_size - 1}), so it would never fire"
            )

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        if self.step is not None and self.step > run.train_iters:
            raise UserError(
                f"plugins.fault-injection.step: {self.step} is past the run's last step ({run.train_iters}), "
                "so it would never fire"
            )

    @property
    def coretrain_vetoes_updates(self) -> bool:
        """With ``skip``, this plugin vetoes updates: the ranks agree on its veto every step."""
        return self.action == "skip"

    def _due(self, rank: int, step: int) -> bool:
        if self.ranks and rank not in self.ranks:
            return False
        if self.attempt is not None and _attempt() != self.attempt:
            return False
        once = self.step is not None and not self.every_step and not self.probability
        limit = self.times if self.times is not None else 1 if once else None
        if limit is not None and self._fired >= limit:
            return False
        if self.step is not None and (step == self.step or (self.every_step and step >= self.step)):
            return True
        if self.probability:
            if self._rng is None:
                self._rng = random.Random(self.seed + rank)
            return self._rng.random() < self.probability
        return False

    @hookimpl
    def pre_step(self, run: Run, step: int) -> None:
        rank = self._first_rank if self._first_rank is not None else run.dist.rank  # (the job's, as started)
        if not self._due(rank, step):
            return
        self._fired += 1
        if self.action != "sleep" or not self.every_step or step == self.step:
            log.warning("fault-injection: %s on rank %d at step %d", self.action, rank, step)
        if self.action == "skip":
            self._veto_at = step
        elif self.action == "nan" and self.parameter is not None:
            self._poison = self._named_parameter(run).register_hook(lambda grad: grad * float("nan"))
        elif self.action == "nan":
            self._poison = run.model.register_forward_hook(self._nan_output)
        elif self.action == "sleep":
            time.sleep(self.sleep_seconds)
        elif self.action == "hang":
            while True:
                time.sleep(3600)
        elif self.action == "raise":
            raise RuntimeError(f"fault-injection: raised on rank {run.dist.rank} at step {step}")
        else:
            signals = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigstop": signal.SIGSTOP}
            os.kill(os.getpid(), signals[self.action])

    def _named_parameter(self, run: Run) -> Any:
        parameters = dict(run.unwrapped_model.named_parameters())
        if self.parameter not in parameters:
            some = sorted(parameters)[:8]
            raise UserError(f"plugins.fault-injection.parameter: the model has no {self.parameter!r}; it has {some}")
        return parameters[self.parameter]

    def _nan_output(self, module: Any, inputs: Any, output: Any) -> Any:
        """The model's loss (a tensor, or a mapping's ``loss``) times NaN: NaN, gradients too."""
        if not self.persistent:
            self._poison.remove()
        if hasattr(output, "keys"):  # a dict, or transformers' ModelOutput
            output["loss"] = output["loss"] * float("nan")
            return output
        return output * float("nan")

    @hookimpl
    def post_step(self) -> None:
        if self._poison is not None:
            self._poison.remove()
            self._poison = None

    @hookimpl
    def before_update(self, run: Run, step: int) -> None:
        if step == self._veto_at:
            run.control.skip_update(f"fault-injection on rank {run.dist.rank}")
