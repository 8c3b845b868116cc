"""Transformers' stacked experts (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, ... : the modules
``@use_experts_implementation`` decorates) as the ``expert-parallel`` plugin takes them.

Such a module holds every expert's weights stacked, expert first (``gate_up_proj``: experts ×
2·intermediate × hidden, ``down_proj``), and its ``forward(hidden_states, top_k_index,
top_k_weights)`` sums each token's experts' outputs, weighted. Made routable, it also has
``n_experts``, ``dispatch`` (None: its own forward, unchanged) and ``expert_rows(rows, expert)``:
rows through the experts this rank holds, computed by transformers' own grouped implementation
on this rank's slices of the weights. With ``dispatch`` set, its forward hands the routing to
it (the tokens go to their experts' ranks and back).
"""

from __future__ import annotations

import functools
from typing import Any

import torch


def stacked_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's experts modules in transformers' stacked form."""
    return [
        module
        for module in model.modules()
        if hasattr(module, "has_gate") and isinstance(getattr(module, "down_proj", None), torch.nn.Parameter)
    ]


def make_routable(module: Any) -> None:
    """Give ``module`` (a transformers experts module) what expert parallelism asks of experts
    (see the module docstring)."""
    own_forward = module.forward
    module.n_experts = int(module.num_experts)
    module.dispatch = None
    module.expert_rows = functools.partial(expert_rows, module)
    module.forward = functools.partial(routed_forward, module, own_forward)


def routed_forward(
    module: Any, own_forward: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The module's own forward, or with ``dispatch`` set, the routing as a (token × expert) map
    and weights handed to it (an index past the last expert, transformers' sentinel, routes
    nowhere)."""
    if module.dispatch is None:
        out: torch.Tensor = own_forward(hidden_states, top_k_index, top_k_weights)
        return out
    count, tokens = module.n_experts, len(hidden_states)
    kept = torch.zeros(tokens, count + 1, dtype=torch.bool, device=hidden_states.device)
    kept = kept.scatter(1, top_k_index, True)[:, :count]
    weights = torch.zeros(tokens, count + 1, dtype=top_k_weights.dtype, device=hidden_states.device)
    weights = weights.scatter(1, top_k_index, top_k_weights)[:, :count]
    routed: torch.Tensor = module.dispatch(module, hidden_states, kept, weights)
    return routed.to(hidden_states.dtype)


def expert_rows(module: Any, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """Each row through the expert ``expert`` (an index among the experts this rank holds)."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    here = LocalExperts(module)
    ones = torch.ones(len(rows), 1, dtype=rows.dtype, device=rows.device)
    out: torch.Tensor = grouped_mm_experts_forward(here, rows, expert[:, None], ones)  # type: ignore[arg-type]
    return out


class LocalExperts:
    """``module`` as this rank holds it: its DTensor parameters as their local slices, as many
    experts as those hold."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self._is_expert_parallel = False  # (no sentinel indices here: every row has its expert)
        self.num_experts = int(local(module.down_proj).size(0))

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        return local(value) if isinstance(value, torch.Tensor) else value


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (differentiably), or the tensor itself."""
    part: torch.Tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return part
