"""torch.distributed under torchrun: who am I, and agreeing on decisions across ranks."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from attrs import define

from coretrain.config import world_size_from_env


@define(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str, backend: str = "auto", timeout_seconds: float = 600.0) -> DistInfo:
    """Join the process group torchrun set up (gloo on CPU, nccl on CUDA); single process otherwise."""
    world_size = world_size_from_env()
    if world_size == 1:
        return DistInfo()
    if not dist.is_initialized():
        chosen = backend if backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
        global _timeout
        _timeout = datetime.timedelta(seconds=timeout_seconds)
        dist.init_process_group(chosen, timeout=_timeout)
    return DistInfo(
        rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=int(os.environ.get("LOCAL_RANK", "0"))
    )


_control_group: object = None
_timeout = datetime.timedelta(minutes=10)


def _cpu_group() -> object:
    """A gloo group for decisions, so agreeing never syncs the GPU stream (None = default group)."""
    global _control_group
    if _control_group is None and dist.get_backend() != "gloo":
        _control_group = dist.new_group(backend="gloo", timeout=_timeout)
    return _control_group


def max_over_ranks(*values: int) -> list[int]:
    """Element-wise maxima over all ranks (one tiny CPU all-reduce; free when single-process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return list(values)
    tensor = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=_cpu_group())
    return tensor.tolist()


class OneStepLate:
    """Maxima over ranks without blocking: the values proposed at one step are all-reduced in
    the background and read at the next, by when the tiny CPU all-reduce has long finished.

    Every rank calls :meth:`exchange` once per step, so all of them act on the same agreed
    values at the same step — one step after the proposal (DESIGN: agreement must not put a
    blocking collective on every step)."""

    def __init__(self, size: int) -> None:
        self._values = torch.zeros(size, dtype=torch.int64)
        self._work: Any = None

    def exchange(self, *proposal: int, now: bool = False) -> list[int]:
        """The agreed maxima of the previous step's proposals (zeros at the first); propose these.

        ``now``: on a step that decides something anyway (a checkpoint is due), agree on these
        proposals too, blocking — a stop that forbids saving must stop the save it coincides with."""
        agreed = [0] * len(proposal)
        if self._work is not None:
            self._work.wait()  # finished a step ago: returns at once
            agreed = self._values.tolist()
            self._work = None
        if now:
            current = max_over_ranks(*proposal)
            return [max(a, b) for a, b in zip(agreed, current)]
        self._values = torch.tensor(proposal, dtype=torch.int64)
        self._work = dist.all_reduce(self._values, op=dist.ReduceOp.MAX, group=_cpu_group(), async_op=True)
        return agreed

    def finish(self) -> None:
        """Wait for the proposal in flight (before the ranks' next collectives or shutdown)."""
        if self._work is not None:
            self._work.wait()
            self._work = None


def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """In-place sum over ranks (free when single-process)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def mean_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """In-place mean over ranks (SUM then divide: gloo has no AVG)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor /= dist.get_world_size()
    return tensor


def shutdown(graceful: bool = False) -> None:
    """Leave the process group; ``graceful`` first waits for every rank, so no rank tears down
    its connections while another is still in a collective (gloo aborts on that)."""
    global _control_group
    if graceful and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
    _control_group = None
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
