"""The gradient norm over parameters that may be DTensors on several meshes — FSDP's on the
data-parallel ranks, expert parallelism's experts on their expert groups, tensor-parallel
splits — and clipping to it. torch's ``clip_grad_norm_`` stacks the per-tensor norms, which
DTensors on different meshes cannot be."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm over these parameters' gradients (a plain tensor): each mesh's part reduced
    over its own ranks, their squares summed."""
    squares = []
    for params in _by_mesh(parameters).values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor's: partial over its ranks
        squares.append(norm.float() ** 2)
    if not squares:
        return torch.zeros(())
    return torch.stack(squares).sum().sqrt()


def clip_to(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients so that their norm ``norm`` is at most ``max_norm``, mesh by mesh."""
    for params in _by_mesh(parameters).values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def _by_mesh(parameters: Iterable[torch.nn.Parameter]) -> dict[Any, list[torch.nn.Parameter]]:
    """The parameters with a gradient, by the mesh their gradient lives on (None: a plain tensor)."""
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    return groups
