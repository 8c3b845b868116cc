"""``guards``: NaN/Inf and loss-spike checks before every update, and Megatron's skipped iterations.

Before each optimizer update (the loop's veto point) the step's mean loss is checked:

- not finite (NaN/Inf), or
- a spike: ``loss >= spike_factor × max(loss over the last `window` accepted steps)``.

With ``check_for_nan_in_grad`` (Megatron's DDP knob, off by default: a device sync per
step) the gradients are checked too, after their reduction (each rank its shards), and the
first parameter whose gradient is not finite is named.

``action`` decides what happens: ``"skip"`` vetoes the update and counts it, ``"warn"`` logs and
lets it through, ``"stop"`` vetoes it, saves a checkpoint and exits with ``exit_code``
(default 3). ``iterations_to_skip`` draws those steps' batches and runs nothing: no forward,
backward or update (Megatron's dummy iterations), so a batch that crashes the model can be
stepped over and the data order after it stays the same.

Better than Megatron: a bad loss never crashes a run whose action is "skip" or "warn"
(Megatron's check_for_nan_in_loss_and_grad raises), and the spike window holds one value
per step — the mean over micro-batches — not per-micro-batch sums, so it does not depend on
the accumulation factor. With several ranks the loss judged is the mean over ranks, so every
rank decides alike (the loop also agrees on any veto: one rank's skip is every rank's).
Checking costs one host sync per step (the decision needs it), and with several ranks one
all-reduce of the loss.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Any, Literal

from attrs import define, field

from coretrain import Run, exit_code, hookimpl, mean_over_ranks, non_negative, positive

log = logging.getLogger("coretrain")


def nonfinite_gradient(model: Any) -> str | None:
    """The first parameter whose gradient (this rank's shard of it) holds a NaN or Inf: one
    fused norm per parameter and one host sync; the name only when there is one."""
    import torch

    named: list[tuple[str, Any]] = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    if not named:
        return None
    grads = [getattr(grad, "_local_tensor", grad) for _, grad in named]  # a DTensor's shard
    finite = torch.stack([norm.float() for norm in torch._foreach_norm(grads)]).isfinite()
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


@define(kw_only=True)
class SavedState:
    """What the guards keep in a checkpoint; a resume checks a saved state against it."""

    recent: list[float]
    """The spike window's losses (finite: only accepted steps enter it)."""
    nan_steps: int = field(validator=non_negative)
    spike_steps: int = field(validator=non_negative)


@define(kw_only=True)
class Guards:
    """Skip, warn about or stop on NaN/Inf and spiky losses; skip chosen iterations."""

    coretrain_vetoes_updates = True  # its before_update may skip an update: the ranks agree on it
    coretrain_state = SavedState  # what on_checkpoint returns: checked before on_resume gets it

    action: Literal["skip", "warn", "stop"] = "skip"
    """What to do about a bad loss."""
    check_nan: bool = True
    """Check the loss for NaN/Inf."""
    check_for_nan_in_grad: bool = False
    """Megatron's: check the reduced gradients for NaN/Inf and name the parameter (a sync per step)."""
    spike_factor: float = field(default=10.0, validator=non_negative)
    """A loss this many times the window's max is a spike; 0 disables the spike check."""
    window: int = field(default=100, validator=positive)
    """How many recent accepted steps the spike check compares against."""
    iterations_to_skip: list[int] = field(factory=list, validator=positive)
    """Steps whose batch is drawn but not run (no forward, backward or update)."""
    exit_code: int = field(default=3, validator=exit_code)
    """Process exit code when action = "stop" fires."""
    nan_steps: int = field(default=0, init=False)
    spike_steps: int = field(default=0, init=False)
    _recent: deque[float] = field(factory=deque, init=False, repr=False)

    @hookimpl
    def pre_step(self, run: Run, step: int) -> None:
        if step in self.iterations_to_skip:
            log.warning("guards: step %d is in iterations_to_skip: its batch is drawn, not run", step)
            run.control.skip_update(f"step {step} is in iterations_to_skip")

    @hookimpl
    def before_update(self, run: Run, step: int, loss: Any) -> None:
        if run.dist.world_size > 1:  # judge what every rank sees: the mean loss over ranks
            loss = mean_over_ranks(loss.detach().clone())
        value = float(loss)  # the one sync per step this guard needs
        problem = None
        if self.check_for_nan_in_grad and (bad := nonfinite_gradient(run.model)) is not None:
            problem = f"the gradient of {bad} is not finite (rank {run.dist.rank})"
            self.nan_steps += 1
        elif self.check_nan and not math.isfinite(value):
            self.nan_steps += 1
            problem = f"loss is {value}"
        elif self.spike_factor and self._recent and value >= self.spike_factor * max(self._recent):
            self.spike_steps += 1
            problem = f"loss spiked to {value:.4g} (>= {self.spike_factor} × {max(self._recent):.4g})"
        if problem is None:
            self._recent.append(value)
            while len(self._recent) > self.window:
                self._recent.popleft()
            return
        if self.action == "warn":
            log.warning("guards: step %d: %s; updating anyway (action = warn)", step, problem)
        elif self.action == "skip":
            log.warning("guards: step %d: %s; update skipped", step, problem)
            run.control.skip_update(problem)
        else:
            log.error("guards: step %d: %s; stopping with exit code %d", step, problem, self.exit_code)
            run.control.skip_update(problem)
            run.control.request_stop(f"guards: {problem}", exit_code=self.exit_code)

    @hookimpl(tryfirst=True)
    def on_log(self, metrics: dict[str, float]) -> None:
        """Counts so far, beside the loop's skipped_updates (which every veto adds to)."""
        metrics["nan_steps"] = float(self.nan_steps)
        metrics["spike_steps"] = float(self.spike_steps)

    @hookimpl
    def on_checkpoint(self) -> dict[str, Any]:
        return {"recent": list(self._recent), "nan_steps": self.nan_steps, "spike_steps": self.spike_steps}

    @hookimpl
    def on_resume(self, state: dict[str, Any]) -> None:
        self._recent = deque(state.get("recent", []))
        self.nan_steps = state.get("nan_steps", 0)
        self.spike_steps = state.get("spike_steps", 0)
