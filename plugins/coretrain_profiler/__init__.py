"""``profiler``: torch.profiler over a window of steps, Chrome traces in the output dir.

Profiles steps ``start`` to ``end`` (inclusive) on the chosen ranks and writes
``profile/rank{R}_steps{start}-{end}.json`` (open in chrome://tracing or Perfetto). With
``memory_snapshot = true`` on CUDA it also records the allocator history over the window and
writes ``profile/rank{R}_memory.pickle`` for pytorch.org/memory_viz. With ``nvtx = true`` on
CUDA, the loop's phases inside the window are NVTX ranges and the window is bracketed by
``cudaProfilerStart``/``Stop``, for ``nsys profile --capture-range=cudaProfilerApi``
(Megatron's ``--profile`` with nsys); off CUDA it does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from attrs import define, field

from coretrain import FieldValueError, Run, hookimpl, positive

log = logging.getLogger("coretrain")


@define(kw_only=True)
class Profiler:
    """torch.profiler on a step window; Chrome trace files per rank."""

    start: int = field(default=10, validator=positive)
    """First profiled step."""
    end: int = field(default=12, validator=positive)
    """Last profiled step (inclusive)."""
    ranks: list[int] = field(factory=lambda: [0])
    """Ranks to profile; empty = all."""
    record_shapes: bool = False
    """torch.profiler's record_shapes: operator input shapes in the trace."""
    profile_memory: bool = False
    """torch.profiler's profile_memory: tensor allocations in the trace."""
    with_stack: bool = False
    """torch.profiler's with_stack: Python stacks in the trace (costly)."""
    memory_snapshot: bool = False
    """CUDA only: record the allocator history and dump a snapshot at the end of the window."""
    nvtx: bool = False
    """CUDA only: NVTX ranges named by the loop's phases over the window, bracketed by
    cudaProfilerStart/Stop for Nsight Systems; a no-op elsewhere."""
    _profile: Any = field(default=None, init=False, repr=False)

    def _mine(self, run: Run) -> bool:
        return not self.ranks or run.dist.rank in self.ranks

    def __attrs_post_init__(self) -> None:
        if self.end < self.start:
            raise FieldValueError("end", f"must be >= start ({self.start}), got {self.end}")

    @hookimpl
    def phase_listener(self, run: Run) -> Callable[[int, str], None] | None:
        if not (self.nvtx and run.device.type == "cuda" and self._mine(run)):
            return None
        from coretrain_profiler.nvtx import PhaseRanges

        return PhaseRanges(self.start, self.end)

    @hookimpl(tryfirst=True)
    def pre_step(self, run: Run, step: int) -> None:
        if step != self.start or not self._mine(run):
            return
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU]
        if run.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.memory_snapshot:
                torch.cuda.memory._record_memory_history()
        self._profile = torch.profiler.profile(
            activities=activities,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        self._profile.__enter__()

    @hookimpl(trylast=True)
    def post_step(self, run: Run, step: int) -> None:
        if self._profile is not None and step >= self.end:
            self._finish(run, step)

    @hookimpl
    def on_train_end(self, run: Run) -> None:
        if self._profile is not None:  # the run ended inside the window
            self._finish(run, run.state.step)

    def _finish(self, run: Run, last: int) -> None:
        import torch

        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        directory = Path(run.output_dir) / "profile"
        directory.mkdir(parents=True, exist_ok=True)
        trace = directory / f"rank{run.dist.rank}_steps{self.start}-{last}.json"
        profile.export_chrome_trace(str(trace))
        log.info("profiler: wrote %s", trace)
        if self.memory_snapshot and run.device.type == "cuda":
            snapshot = directory / f"rank{run.dist.rank}_memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))  # type: ignore[no-untyped-call]
            torch.cuda.memory._record_memory_history(enabled=None)
            log.info("profiler: wrote %s", snapshot)
