"""Where a step's time goes: waiting for data, forward + backward, the optimizer step, and,
per log interval, evaluation and checkpointing (Megatron's training_log timers).

Measured on the host, without a device sync: the loop marks ``perf_counter()`` at phase
boundaries (a fraction of a microsecond each). On CUDA, forward + backward and the optimizer
step are timed with CUDA events recorded at the same boundaries and read at the log step,
after the interval's one host sync has completed them, so they measure the GPU's time, not
the time to launch kernels. The data wait is host time everywhere: it is the host that waits.
"""

from __future__ import annotations

from typing import Any

import torch

STEP_PHASES = ("data", "forward_backward", "optimizer")
INTERVAL_PHASES = ("eval", "checkpoint")


class PhaseTimes:
    """Seconds per phase since the last log; :meth:`per_step` turns them into metrics."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = dict.fromkeys(STEP_PHASES + INTERVAL_PHASES, 0.0)
        self._events: list[tuple[Any, Any, Any]] = []

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self._events.clear()

    def step(
        self,
        started: float,
        data_ready: float,
        backward_done: float,
        updated: float,
        events: tuple[Any, Any, Any] | None = None,
    ) -> None:
        """One step's host marks (and, on CUDA, its events: forward start, backward end, update end)."""
        seconds = self.seconds
        seconds["data"] += data_ready - started
        if events is not None:
            self._events.append(events)
        else:
            seconds["forward_backward"] += backward_done - data_ready
            seconds["optimizer"] += updated - backward_done

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    def events(self) -> tuple[Any, Any, Any] | None:
        """Three CUDA events to record at the step's boundaries; None on CPU."""
        if not self.cuda:
            return None
        new = torch.cuda.Event
        return new(enable_timing=True), new(enable_timing=True), new(enable_timing=True)  # type: ignore[no-untyped-call]

    def collect(self, steps: int) -> dict[str, float]:
        """``time/PHASE``: seconds per step for step phases, seconds in the interval for the others."""
        if self._events:
            self._events[-1][2].synchronize()  # the log step syncs anyway: wait for the last event
        for start, backward_end, update_end in self._events:
            self.seconds["forward_backward"] += start.elapsed_time(backward_end) / 1000
            self.seconds["optimizer"] += backward_end.elapsed_time(update_end) / 1000
        self._events.clear()
        metrics = {f"time/{p}": self.seconds[p] / steps if steps else 0.0 for p in STEP_PHASES}
        metrics.update({f"time/{p}": self.seconds[p] for p in INTERVAL_PHASES})
        return metrics
