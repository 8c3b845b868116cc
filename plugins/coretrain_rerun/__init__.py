"""``rerun``: Megatron's rerun state machine — a bad loss is computed again before it is believed.

On a NaN/Inf loss (``check_for_nan_in_loss``) or a spiky one (``check_for_spiky_loss``: at
least ``spiky_loss_factor`` × the largest of the first ``spiky_loss_samples`` losses, Megatron's
``is_unexpectedly_large``), the step's forward and backward run again on the same batches and
the same random state (dropout draws alike), its first gradients dropped, and the two results
are compared (Megatron's relative difference, NaN equal to NaN, within ``tolerance``):

- **transient** (the rerun differs): a fault that did not come back — a flipped bit, a bad
  kernel launch. Logged; the rerun's gradients update the model. With ``exit_on_transient``
  the run then saves a checkpoint and exits with 16 (Megatron's "resume to disambiguate") so
  the scheduler can restart it on other hardware; nothing is lost.
- **persistent** (the same result again): the model and data make it. A NaN/Inf stops the run
  with a checkpoint (the update skipped) and exit code 17 (Megatron's "failed on result
  validation"), one line naming the step and its samples; a spike (``spiky_loss_fatal`` off,
  as in Megatron) is logged and its update applied.

Every rank checks its own loss (a fault is local; the mean over ranks would hide which rank);
any rank's rerun is every rank's, and the verdict is agreed (the worst one wins).

``mode = "report_determinism_stats"`` reruns every step once and logs the relative difference
of the two losses (``rerun/max_diff``, ``rerun/mean_diff`` per log interval): how far this
model, kernels and hardware are from deterministic. ``"disabled"`` checks nothing.

Differences from Megatron, on purpose: the first step is checked too (a checkpoint can be
taken before any update here), and a persistent fault is not rerun from the checkpoint on
another GPU (the checkpoint is written after the step, so a resume continues with the next
batch: the named step is how to find the batch, or skip it with ``guards.iterations_to_skip``).
Cost in ``validate_results``: one host sync (the loss) and one copy of the random state per
step, and with several ranks one tiny all-reduce (the rerun agreement); a rerun costs a step.
"""

from __future__ import annotations

import logging
import math
import random
import sys
from typing import Any, Literal

import torch
from attrs import define, field

from coretrain import Run, exit_code, hookimpl, max_over_ranks, non_negative, positive

log = logging.getLogger("coretrain")

RESUME_TO_DISAMBIGUATE = 16
"""Megatron's exit code for "restart the job (elsewhere) to tell what happened"."""
FAILED_ON_RESULT_VALIDATION = 17
"""Megatron's exit code for a result that failed validation and came back."""

FINE, TRANSIENT, PERSISTENT, FATAL = 0, 1, 2, 3
"""Verdicts on a rerun, ordered so that the ranks agree on the worst (FATAL: persistent, and a
NaN/Inf or, with ``spiky_loss_fatal``, a spike)."""


def relative_difference(first: float, second: float) -> float:
    """Megatron's ``_compare_floats``: 0 when equal (NaN equals NaN), inf when one is NaN or
    inf and the other is not, else |a - b| / mean(|a|, |b|)."""
    if first == second or (math.isnan(first) and math.isnan(second)):
        return 0.0
    if not (math.isfinite(first) and math.isfinite(second)):
        return math.inf
    return abs((first - second) / (first + second) * 2)


def random_state() -> dict[str, Any]:
    """Every random stream a step may draw from: torch's (CPU and each GPU), Python's, NumPy's."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def restore_random_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])


@define(kw_only=True)
class SavedState:
    """What a checkpoint keeps: the spike estimate and the counts, so a resume judges alike."""

    samples: int = field(validator=non_negative)
    max_loss: float
    reruns: int = field(validator=non_negative)
    transient: int = field(validator=non_negative)
    persistent: int = field(validator=non_negative)


@define(kw_only=True)
class Rerun:
    """Compute a NaN/Inf or spiky loss again on the same batch and random state; tell a transient
    fault from a persistent one; or report how deterministic steps are."""

    coretrain_vetoes_updates = True  # asks for reruns and skips updates: the ranks agree each step
    coretrain_state = SavedState

    mode: Literal["disabled", "validate_results", "report_determinism_stats", "report_stats"] = "validate_results"
    """Megatron's ``rerun_mode`` (``report_stats`` is its newer name for ``report_determinism_stats``)."""
    check_for_nan_in_loss: bool = True
    """Rerun a step whose loss is NaN or Inf on any rank."""
    check_for_spiky_loss: bool = False
    """Rerun a step whose loss is ``spiky_loss_factor`` × the largest early loss or more."""
    spiky_loss_factor: float = field(default=10.0, validator=positive)
    """Megatron's ``SPIKY_LOSS_FACTOR``."""
    spiky_loss_samples: int = field(default=100, validator=positive)
    """How many first losses estimate the largest expected one (Megatron: 100)."""
    spiky_loss_fatal: bool = False
    """Stop on a spike that comes back, as on a NaN (Megatron: a spike is not fatal)."""
    tolerance: float = field(default=0.0, validator=non_negative)
    """Largest relative difference of two runs of a step that still counts as the same result."""
    exit_on_transient: bool = False
    """After a transient fault, save and exit with 16 so the scheduler moves the job."""
    persistent_exit_code: int = field(default=FAILED_ON_RESULT_VALIDATION, validator=exit_code)
    """The exit code of a persistent fault (Megatron's 17)."""
    transient_exit_code: int = field(default=RESUME_TO_DISAMBIGUATE, validator=exit_code)
    """The exit code after a transient fault with exit_on_transient (Megatron's 16)."""
    _samples: int = field(default=0, init=False)
    _max_loss: float = field(default=0.0, init=False)
    _counts: dict[str, int] = field(factory=lambda: dict.fromkeys(("reruns", "transient", "persistent"), 0), init=False)
    _saved: dict[str, Any] | None = field(default=None, init=False, repr=False)
    _runs: int = field(default=0, init=False, repr=False)
    """How often this step's forward and backward has started (2: it is being rerun)."""
    _first: tuple[float, str | None] = field(default=(0.0, None), init=False, repr=False)
    """The step's first loss on this rank, and what was wrong with it."""
    _diffs: list[float] = field(factory=list, init=False, repr=False)

    @property
    def _stats(self) -> bool:
        return self.mode in ("report_determinism_stats", "report_stats")

    @hookimpl
    def pre_step(self) -> None:
        if self.mode != "disabled":
            self._saved, self._runs = random_state(), 0  # what the step is about to draw from

    @hookimpl(wrapper=True)
    def forward_backward(self) -> Any:
        """A rerun draws what the first run drew, on every rank (whichever rank asked for it)."""
        if self._runs and self._saved is not None:
            restore_random_state(self._saved)
        self._runs += 1
        return (yield)

    @hookimpl
    def before_update(self, run: Run, step: int, loss: torch.Tensor) -> None:
        if self.mode == "disabled":
            return
        value = float(loss)  # this rank's loss on the host: the one sync per step the check needs
        if self._runs == 1:
            problem = "every step is run twice" if self._stats else self._problem(value)
            self._first = (value, problem)
            if problem is not None:
                self._counts["reruns"] += 1
                run.control.skip_update(f"rerun: step {step}: {problem}", rerun=True)
            return
        first, problem = self._first
        difference = relative_difference(first, value)
        if self._stats:
            self._diffs.append(difference)
        else:
            self._judge(run, step, problem, first, value, difference)

    def _problem(self, value: float) -> str | None:
        """What is wrong with this rank's loss, or None; a good loss feeds the spike estimate."""
        if self.check_for_nan_in_loss and not math.isfinite(value):
            return f"loss is {value}"
        if not self.check_for_spiky_loss or not math.isfinite(value):
            return None
        if self._samples < self.spiky_loss_samples:
            self._samples += 1
            self._max_loss = max(self._max_loss, abs(value))
            return None
        if abs(value) >= self.spiky_loss_factor * self._max_loss:
            return f"spiky loss {value:.6g} (>= {self.spiky_loss_factor:g} × {self._max_loss:.6g})"
        return None

    def _verdict(self, problem: str | None, first: float, difference: float) -> int:
        if problem is None:
            return FINE  # another rank asked for the rerun
        if difference > self.tolerance:
            return TRANSIENT
        return FATAL if not math.isfinite(first) or self.spiky_loss_fatal else PERSISTENT

    def _judge(self, run: Run, step: int, problem: str | None, first: float, again: float, difference: float) -> None:
        """The verdict on this rank, agreed over ranks (the worst wins), and what follows from it."""
        mine = self._verdict(problem, first, difference)
        verdict = max_over_ranks(mine)[0]
        consumed = run.state.consumed_samples
        where = f"step {step} (samples {consumed}..{consumed + run.global_batch_size - 1})"
        if mine == TRANSIENT:
            rank = run.dist.rank
            log.error("rerun: rank %d, %s: %s; the rerun gave %.6g: a transient fault", rank, where, problem, again)
        elif mine != FINE:
            log.error("rerun: rank %d, %s: %s, and the same again on rerun", run.dist.rank, where, problem)
        if verdict == TRANSIENT:
            self._counts["transient"] += 1
            if self.exit_on_transient:
                reason = f"rerun: a transient fault at {where}; exiting so that the job restarts elsewhere"
                run.control.request_stop(reason, exit_code=self.transient_exit_code)
        elif verdict == PERSISTENT:
            self._counts["persistent"] += 1  # a spike that comes back: the data's, as Megatron takes it
        elif verdict == FATAL:
            self._counts["persistent"] += 1
            run.control.skip_update(f"rerun: a bad loss at {where}, twice")
            reason = f"rerun: the loss at {where} is bad again on the same batch and random state: a persistent fault"
            run.control.request_stop(reason, exit_code=self.persistent_exit_code)

    @hookimpl(tryfirst=True)
    def on_log(self, metrics: dict[str, float]) -> None:
        for name, count in self._counts.items():
            metrics[f"rerun/{name}"] = float(count)
        if self._diffs:
            metrics["rerun/max_diff"] = max(self._diffs)
            metrics["rerun/mean_diff"] = sum(self._diffs) / len(self._diffs)
            self._diffs.clear()

    @hookimpl
    def on_checkpoint(self) -> dict[str, Any]:
        return {"samples": self._samples, "max_loss": self._max_loss, **self._counts}

    @hookimpl
    def on_resume(self, state: dict[str, Any]) -> None:
        self._samples, self._max_loss = state["samples"], state["max_loss"]
        self._counts = {name: state[name] for name in self._counts}
