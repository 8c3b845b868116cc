"""NVTX ranges named by the loop's phases, for Nsight Systems: ``data 12``, ``forward_backward 12``,
``update 12``... one open at a time, each closed by the next mark, inside the profiled window,
with ``cudaProfilerStart``/``Stop`` at its edges (``nsys profile --capture-range=cudaProfilerApi``
records just the window)."""

from __future__ import annotations

from typing import Any

import torch


class PhaseRanges:
    """The listener: closes the open range and opens the phase's, for steps start..end."""

    def __init__(self, start: int, end: int, nvtx: Any = None, cudart: Any = None) -> None:
        self.start, self.end = start, end
        self.nvtx = nvtx or torch.cuda.nvtx
        self.cudart = cudart if cudart is not None else torch.cuda.cudart()  # type: ignore[no-untyped-call]
        self.open, self.capturing = False, False

    def __call__(self, step: int, phase: str) -> None:
        if self.open:
            self.nvtx.range_pop()
            self.open = False
        inside = self.start <= step <= self.end and phase != "end"
        if inside != self.capturing:  # the window's edges: the first mark of start, the first after end
            (self.cudart.cudaProfilerStart if inside else self.cudart.cudaProfilerStop)()
            self.capturing = inside
        if inside:
            self.nvtx.range_push(f"{phase} {step}")
            self.open = True
