"""``early-stopping``: stop training when an evaluated metric stops improving, as Lightning's
``EarlyStopping`` callback and HF Trainer's ``EarlyStoppingCallback`` do.

After each evaluation (``on_eval``) the watched metric either improves on the best so far by
more than ``min_delta`` or counts one evaluation against ``patience``; when ``patience``
evaluations in a row did not improve, the plugin asks for a stop through ``run.control``: the
loop saves a checkpoint, ``on_train_end`` sees "stopped", the process exits 0 and the log
says why. Evaluated metrics are the same on every rank, and the loop agrees a request made at
an evaluation step at that step, so every rank stops after the same step as one rank would.

The count and the best value are saved in every checkpoint: a resumed run goes on counting,
and resubmitting a run that has already stopped ends it again before its first step (a
requeued job does not train on past its stop).
"""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from attrs import define, field

from coretrain import Run, UserError, hookimpl, non_negative, positive

log = logging.getLogger("coretrain")


@define(kw_only=True)
class SavedState:
    """What early stopping keeps in a checkpoint; a resume checks a saved state against it."""

    metric: str
    best: float | None
    best_step: int | None = field(validator=non_negative)
    bad_evaluations: int = field(validator=non_negative)
    stopped_at: int | None = field(validator=non_negative)


@define(kw_only=True)
class EarlyStopping:
    """Stop when ``metric`` has not improved for ``patience`` evaluations."""

    coretrain_state = SavedState  # what on_checkpoint returns: checked before on_resume gets it

    metric: str = "valid/loss"
    """An evaluated metric: ``valid/loss``, ``valid/accuracy``, ``valid/NAME/loss`` for a named
    validation set, or any value your model returns (``valid/<name>``)."""
    mode: Literal["min", "max"] = "min"
    """"min": lower is better (a loss); "max": higher is better (accuracy)."""
    patience: int = field(default=3, validator=positive)
    """Evaluations in a row without an improvement before training stops."""
    min_delta: float = field(default=0.0, validator=non_negative)
    """An improvement must beat the best by more than this."""
    check_finite: bool = True
    """Stop at once when the metric is NaN or infinite (nothing later can be trusted)."""
    best: float | None = field(default=None, init=False)
    best_step: int | None = field(default=None, init=False)
    bad_evaluations: int = field(default=0, init=False)
    stopped_at: int | None = field(default=None, init=False)

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        if run.cadence.eval_every == 0 and not run.config.train.skip_train:
            raise UserError(
                f"plugins.early-stopping: watches {self.metric}, but this run never evaluates during "
                "training; set train.eval_interval (and train.eval_iters or train.eval_full) and give "
                "the data provider a valid split"
            )

    @hookimpl
    def on_eval(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        split = self.metric.split("/", 1)[0]
        if not any(name.startswith(f"{split}/") for name in metrics):
            return  # another split's evaluation (test after training)
        if self.metric not in metrics:
            raise UserError(
                f"plugins.early-stopping.metric: {self.metric!r} is not among the evaluated metrics "
                f"({', '.join(sorted(metrics))}); set it to one of these"
            )
        value = metrics[self.metric]
        if self.check_finite and not math.isfinite(value):
            self._stop(run, step, f"{self.metric} is {value} at step {step}")
            return
        if self._improves(value):
            self.best, self.best_step, self.bad_evaluations = value, step, 0
            return
        self.bad_evaluations += 1
        if self.bad_evaluations >= self.patience:
            self._stop(
                run,
                step,
                f"{self.metric} did not improve on {self.best:.6g} (step {self.best_step}) by more than "
                f"{self.min_delta:g} in {self.bad_evaluations} evaluations",
            )

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def _stop(self, run: Run, step: int, why: str) -> None:
        self.stopped_at = step
        run.control.request_stop(f"early stopping: {why}")

    @hookimpl
    def on_checkpoint(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "best": self.best,
            "best_step": self.best_step,
            "bad_evaluations": self.bad_evaluations,
            "stopped_at": self.stopped_at,
        }

    @hookimpl
    def on_resume(self, run: Run, state: dict[str, Any]) -> None:
        if state.get("metric") != self.metric:
            return  # not watched then, or another metric: count afresh
        self.best, self.best_step = state["best"], state["best_step"]
        self.bad_evaluations, self.stopped_at = state["bad_evaluations"], state["stopped_at"]
        if self.stopped_at is not None:
            run.control.request_stop(
                f"early stopping: this run already stopped at step {self.stopped_at} "
                "(raise plugins.early-stopping.patience or disable the plugin to train on)"
            )
