"""``loss-scale``: fp16's loss scaling as Megatron does it, by Megatron's names.

Torch's ``GradScaler`` (what ``run.precision = "fp16"`` uses alone) halves the scale at every
overflow. Megatron's ``DynamicGradScaler`` waits for ``hysteresis`` overflows — counted until
the scale next grows, not reset by a clean step — before it backs off, never goes below
``min_loss_scale``, starts at ``initial_loss_scale`` and doubles after ``loss_scale_window``
clean steps; ``loss_scale`` fixes the scale instead (its ``ConstantGradScaler``). Either way a
step whose gradients overflowed is skipped, as with torch's. The trackers are saved with the
scaler's state in every checkpoint.

    [run]
    precision = "fp16"
    [plugins.loss-scale]
    initial_loss_scale = 65536.0     # Megatron's default: 2**32
    min_loss_scale = 1.0
    loss_scale_window = 1000
    hysteresis = 2

Reading the overflow flag is the one host sync per step fp16 already has.
"""

from __future__ import annotations

import collections
from typing import Any

import torch
from attrs import define, field
from torch.amp.grad_scaler import _refresh_per_optimizer_state

from coretrain import FieldValueError, Run, UserError, hookimpl, positive


class MegatronGradScaler(torch.amp.GradScaler):
    """torch's GradScaler (scale, unscale_, step skip on overflow) with Megatron's update rule."""

    def __init__(self, device: str, initial: float, minimum: float, window: int, hysteresis: int, static: bool) -> None:
        super().__init__(device, init_scale=initial, growth_factor=2.0, backoff_factor=0.5, growth_interval=window)
        self.min_scale, self.hysteresis, self.static = minimum, hysteresis, static
        self.hysteresis_tracker = hysteresis
        self.clean_steps = 0

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Megatron's ``DynamicGradScaler.update`` (or nothing, for a static scale), from the
        overflow flags ``unscale_`` left (torch's own update reads them the same way)."""
        if not self._enabled or new_scale is not None:
            return super().update(new_scale)
        states = self._per_optimizer_states.values()
        overflowed = any(bool(found.item()) for state in states for found in state["found_inf_per_device"].values())
        scale = self.get_scale()
        if self.static:
            pass
        elif overflowed:
            self.clean_steps = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                scale = max(scale * self._backoff_factor, self.min_scale)
        else:
            self.clean_steps += 1
            if self.clean_steps == self._growth_interval:
                self.clean_steps, self.hysteresis_tracker = 0, self.hysteresis
                scale *= self._growth_factor
        assert self._scale is not None  # scale() ran this step
        self._scale.fill_(scale)
        self._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)  # as torch's update
        return None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "hysteresis_tracker": self.hysteresis_tracker, "clean_steps": self.clean_steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        self.hysteresis_tracker = state.pop("hysteresis_tracker", self.hysteresis)
        self.clean_steps = state.pop("clean_steps", state.get("_growth_tracker", 0))
        super().load_state_dict(state)


def _at_most_initial(plugin: Any, attribute: Any, value: float) -> None:
    if value > plugin.initial_loss_scale:
        raise FieldValueError(attribute.name, f"must be <= initial_loss_scale ({plugin.initial_loss_scale:g})")


@define(kw_only=True)
class LossScale:
    """Megatron's fp16 loss scaler: hysteresis, a floor, or a static scale."""

    initial_loss_scale: float = field(default=2.0**32, validator=positive)
    """The scale the run starts at (Megatron's default: 2**32)."""
    min_loss_scale: float = field(default=1.0, validator=[positive, _at_most_initial])
    """The floor the scale never goes below."""
    loss_scale_window: int = field(default=1000, validator=positive)
    """Clean steps before the scale doubles."""
    hysteresis: int = field(default=2, validator=positive)
    """Overflows (since the scale last grew) before it halves."""
    loss_scale: float | None = field(default=None, validator=positive)
    """A static scale (Megatron's ``loss_scale``); unset: the dynamic one above."""

    @hookimpl
    def configure_optimizer(self, run: Run) -> None:
        if run.config.run.precision != "fp16":
            raise UserError(
                f'plugins.loss-scale: loss scaling is for run.precision = "fp16" (this run is '
                f'"{run.config.run.precision}"); set it, or drop [plugins.loss-scale]'
            )
        static = self.loss_scale is not None
        initial = self.loss_scale if self.loss_scale is not None else self.initial_loss_scale
        run.grad_scaler = MegatronGradScaler(
            run.device.type, initial, self.min_loss_scale, self.loss_scale_window, self.hysteresis, static
        )
