"""``batch-rampup``: grow the global batch during training (Megatron's rampup_batch_size).

``rampup_batch_size = [start, increment, ramp_samples]``: the global batch starts at
``start`` and grows by ``increment`` each time another ramp_samples / ((global − start) /
increment) samples have been consumed, reaching ``train.global_batch_size`` after
``ramp_samples`` samples — Megatron's formula. Each step's batch must be a multiple of
micro_batch_size × data-parallel size; ``train.decrease_batch_size_if_needed`` (or this
plugin's own option of that name) rounds it down instead of stopping, and counts the samples
that rounding left out. The LR schedule counts samples, so warmup and decay stay where they
belong while the batch grows.
"""

from __future__ import annotations

import logging
from typing import Any

from attrs import define, field

from coretrain import Run, StepOutputs, hookimpl, non_negative

log = logging.getLogger("coretrain")


@define(kw_only=True)
class SavedState:
    """What the rampup keeps in a checkpoint; a resume checks a saved state against it."""

    samples_left_out: int = field(validator=non_negative)


@define(kw_only=True)
class BatchRampup:
    """Megatron's batch-size rampup: [start, increment, ramp_samples]."""

    coretrain_state = SavedState  # what on_checkpoint returns: checked before on_resume gets it

    rampup_batch_size: list[int]
    """[start, increment, ramp_samples]."""
    decrease_batch_size_if_needed: bool = False
    """Round a ramp batch down to a multiple of micro × data-parallel instead of failing (also
    on when ``train.decrease_batch_size_if_needed`` is)."""
    samples_left_out: int = field(default=0, init=False)
    _last: int = field(default=0, init=False, repr=False)
    _target: int = field(default=0, init=False, repr=False)

    def _check(self, run: Run) -> None:
        from coretrain import UserError

        if len(self.rampup_batch_size) != 3:
            raise UserError("plugins.batch-rampup.rampup_batch_size: expected [start, increment, ramp_samples]")
        start, increment, ramp_samples = self.rampup_batch_size
        target = self._target
        if not (0 < start <= target and increment > 0 and ramp_samples >= 0 and (target - start) % increment == 0):
            raise UserError(
                f"plugins.batch-rampup.rampup_batch_size: need 0 < start <= global_batch_size ({target}), "
                f"increment > 0 and (global - start) divisible by increment; got {self.rampup_batch_size}"
            )

    def global_batch_at(self, consumed_samples: int, target: int) -> int:
        """Megatron's RampupBatchsizeNumMicroBatchesCalculator.update."""
        start, increment, ramp_samples = self.rampup_batch_size
        if consumed_samples > ramp_samples or target == start:
            return target
        per_increment = ramp_samples / ((target - start) // increment)
        return min(start + int(consumed_samples / per_increment) * increment, target)

    def usable_batch(self, run: Run, step: int, consumed_samples: int) -> int:
        """The global batch of ``step``: Megatron's, rounded down to whole micro-batches when allowed.
        A pure function of its arguments and the config, so the steps of a ``train_samples`` run
        can be planned with it before training."""
        from coretrain import UserError

        if not self._target:  # the configured global batch (run.global_batch_size follows the ramp)
            self._target = run.config.train.global_batch_size or run.samples_per_micro_batch
            self._check(run)
        per_pass = run.samples_per_micro_batch  # data-parallel: a tensor-parallel group shares one batch
        wanted = self.global_batch_at(consumed_samples, self._target)
        usable = wanted // per_pass * per_pass
        allowed = self.decrease_batch_size_if_needed or run.config.train.decrease_batch_size_if_needed
        if usable != wanted and (not allowed or usable == 0):
            raise UserError(
                f"plugins.batch-rampup: step {step} wants a global batch of {wanted}, not a "
                f"multiple of micro_batch_size × data-parallel size ({per_pass}); set "
                "train.decrease_batch_size_if_needed = true or change the rampup"
            )
        return usable

    @hookimpl
    def num_micro_batches(self, run: Run, step: int, consumed_samples: int) -> int:
        return self.usable_batch(run, step, consumed_samples) // run.samples_per_micro_batch

    @hookimpl
    def post_step(self, run: Run, step: int, outputs: StepOutputs) -> None:
        """What the step really took: the samples rounding left out, and a log line when the batch grows."""
        used = outputs.global_batch_size
        self.samples_left_out += self.global_batch_at(run.state.consumed_samples - used, self._target) - used
        if used != self._last:
            log.info("batch-rampup: global batch %d from step %d", used, step)
            self._last = used

    @hookimpl
    def on_checkpoint(self) -> dict[str, Any]:
        return {"samples_left_out": self.samples_left_out}

    @hookimpl
    def on_resume(self, state: dict[str, Any]) -> None:
        self.samples_left_out = state.get("samples_left_out", 0)
