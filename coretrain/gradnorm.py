"""The gradient norm over parameters that may be DTensors on several meshes — FSDP's on the
data-parallel ranks, expert parallelism's experts on their expert groups, tensor-parallel
splits — and clipping to it. torch's ``clip_grad_norm_`` stacks the per-tensor norms, which
DTensors on different meshes cannot be; and its scaling of DTensor gradients costs a DTensor
dispatch that a rank scaling its own part of each does not."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm over these parameters' gradients (a plain tensor): torch's own when they are on
    one mesh (or none), else each mesh's part reduced over its own ranks, their squares summed."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    groups = list(by_mesh.values()) or [[]]
    if len(groups) == 1:
        return _whole(torch.nn.utils.get_total_norm(groups[0]))
    squares = [_whole(torch.nn.utils.get_total_norm(grads)).float() ** 2 for grads in groups]
    return torch.stack(squares).sum().sqrt()


@torch.no_grad()
def clip_to(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients so that their norm ``norm`` is at most ``max_norm``, as torch's
    ``clip_grads_with_norm_`` does. Each rank scales its own part of each gradient: a scalar
    commutes with every placement (shards, replicas, partial sums), and no DTensor op runs —
    DTensor works out a placement for the whole list of gradients, afresh for each new mesh."""
    coefficient = torch.clamp(max_norm / (_whole(norm) + 1e-6), max=1.0)  # (a DTensor norm too: torch's own)
    grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in parameters if p.grad is not None]
    for device in {grad.device for grad in grads}:
        on_device = [grad for grad in grads if grad.device == device]
        torch._foreach_mul_(on_device, coefficient.to(device))


def _whole(norm: torch.Tensor) -> torch.Tensor:
    """A norm of DTensors (partial over their ranks) as a plain tensor."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
