"""torch.distributed under torchrun: who am I, and agreeing on decisions across ranks."""

from __future__ import annotations

import datetime
import os

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


def init_distributed(device_type: str, backend: str = "auto", timeout_minutes: float = 10.0) -> DistInfo:
    """Join the process group torchrun set up (gloo on CPU, nccl on CUDA); single process otherwise."""
    world_size = world_size_from_env()
    if world_size == 1:
        return DistInfo()
    if not dist.is_initialized():
        chosen = backend if backend != "auto" else ("nccl" if device_type == "cuda" else "gloo")
        global _timeout
        _timeout = datetime.timedelta(minutes=timeout_minutes)
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
