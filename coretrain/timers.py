"""Where a step's time goes: waiting for data, forward + backward, the optimizer step, and,
per log interval, evaluation and checkpointing (Megatron's training_log timers).

Measured on the host, without a device sync: a phase listener (:mod:`coretrain.phases`) reads
``perf_counter()`` at the step's phase boundaries (a fraction of a microsecond each). On
CUDA, forward + backward and the optimizer step are timed with CUDA events recorded at the
same boundaries and read at the log step,
after the interval's one host sync has completed them, so they measure the GPU's time, not
the time to launch kernels. The data wait is host time everywhere: it is the host that waits.
"""

from __future__ import annotations

import logging
from time import perf_counter
from typing import Any

import torch

log = logging.getLogger("coretrain")

STEP_PHASES = ("data", "forward_backward", "optimizer")
INTERVAL_PHASES = ("eval", "checkpoint")


class PhaseTimes:
    """Seconds per phase since the last log; :meth:`per_step` turns them into metrics."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = dict.fromkeys(STEP_PHASES + INTERVAL_PHASES, 0.0)
        self._events: list[tuple[Any, Any, Any]] = []
        self._pending: tuple[Any, Any, Any] = (None, None, None)
        self._since = perf_counter()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self._events.clear()

    def mark(self, step: int, phase: str) -> None:
        """A phase listener (:mod:`coretrain.phases`): the step's boundaries, timed as they pass
        (one comparison chain, no further call: it runs at every mark of every step)."""
        if phase == "data":
            self._since = perf_counter()
        elif phase == "forward_backward":
            now = perf_counter()
            self.seconds["data"] += now - self._since
            self._since = now
            if self.cuda:
                self._pending = self._new_events()
                self._pending[0].record()
        elif phase == "update":
            if self.cuda:
                self._pending[1].record()
            else:
                now = perf_counter()
                self.seconds["forward_backward"] += now - self._since
                self._since = now
        elif phase == "post_step":
            if self.cuda:
                self._pending[2].record()
                self._events.append(self._pending)
            else:
                self.seconds["optimizer"] += perf_counter() - self._since

    @staticmethod
    def _new_events() -> tuple[Any, Any, Any]:
        new = torch.cuda.Event
        return new(enable_timing=True), new(enable_timing=True), new(enable_timing=True)  # type: ignore[no-untyped-call]

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

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


INPUT_BOUND_SHARE = 0.3
"""A run whose slowest rank waits this share of a step for data is told so, once."""


class InputBoundNotice:
    """Once per run: most of a step waits for data, and which setting helps."""

    def __init__(self, num_workers: int) -> None:
        self.num_workers, self.said = num_workers, False

    def check(self, metrics: dict[str, float]) -> None:
        step_time, data_max = metrics.get("time/step", 0.0), metrics.get("time/data_max", 0.0)
        if self.said or step_time <= 0 or data_max < INPUT_BOUND_SHARE * step_time:
            return
        self.said = True
        workers = self.num_workers
        hint = (
            "set data.num_workers (batches are read in the training loop now)"
            if workers == 0
            else f"raise data.num_workers (now {workers}) or data.prefetch_factor, or make the dataset's reads cheaper"
        )
        log.warning(
            "input-bound: %.0f%% of each step waits for data (%.1f ms of %.1f ms on the slowest rank); %s",
            100 * data_max / step_time,
            1e3 * data_max,
            1e3 * step_time,
            hint,
        )
