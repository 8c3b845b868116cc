"""Figures of the whole model on any layout: each rank holds a part of it (a pipeline stage,
FSDP or tensor-parallel shards, a replica), and a sum over the model's parameters is a sum
over the ranks' parts in which each element counts once — what one rank holding the whole
model would compute (a norm, a count of zeros, a parameter count). A library of coretrain-plugins
(the ``progress`` and ``model-stats`` plugins use it); formerly ``coretrain.WholeModel``, which
still finds it here, with a deprecation warning."""

from __future__ import annotations

import torch
import torch.distributed as dist
from coretrain_blocks import blocks_of

from coretrain import SHARED_PARAMETERS, Run, is_sharded


class WholeModel:
    """This rank's parameters as parts of the whole model's, found once per run (every rank
    must build it at the same point: one gather of names, one all-reduce); :meth:`sums` then
    turns per-parameter sums over this rank's part into the whole model's with one all-reduce.

    ``names``: every parameter of the whole model, in one order on every rank; ``blocks``: the
    block (a transformer layer, :func:`coretrain.blocks_of`) of each, "other" for the rest;
    ``numel``: the whole model's parameter count."""

    def __init__(self, run: Run) -> None:
        self.model = model = run.unwrapped_model
        module_names = {id(module): name for name, module in model.named_modules()}
        own_blocks = [module_names[id(block)] for block in blocks_of(model)]
        self.spread = run.dist.world_size > 1 and (is_sharded(model) or run.dist.pp_size > 1)
        params = self.params
        mine = ([(name, p.numel()) for name, p in params.items()], own_blocks)
        everyone = [mine]
        if self.spread:  # the other parts' names (a stage holds other layers)
            everyone = [mine] * run.dist.world_size
            dist.all_gather_object(everyone, mine)
        full = {name: numel for params, _ in everyone for name, numel in params}
        self.names = sorted(full)
        self.numel = sum(full.values())
        block_names = sorted({block for _, blocks in everyone for block in blocks}, key=len, reverse=True)
        self.blocks = [next((b for b in block_names if n.startswith(b + ".")), "other") for n in self.names]
        self.device = next(model.parameters()).device
        held = torch.tensor([_local(params[n]).numel() if n in params else 0 for n in self.names])
        held = held.to(self.device, torch.float32)
        if self.spread:
            dist.all_reduce(held)
        # each element counts once: a part held by k ranks weighs 1/k
        full_sizes = torch.tensor([full[n] for n in self.names], device=self.device, dtype=torch.float32)
        self.weights = full_sizes / held.clamp(min=1)

    @property
    def params(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters by name, its copies of weights counted elsewhere left out
        (looked up each time: a wrapper may have replaced a parameter object since)."""
        copies = set(getattr(self.model, SHARED_PARAMETERS, ()))
        return {name: p for name, p in self.model.named_parameters() if name not in copies}

    def sums(self, per_param: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sums over this rank's part of each parameter (by name) -> the whole model's, one per
        name in :attr:`names`' order (one all-reduce when the model is spread over ranks)."""
        zero = torch.zeros((), device=self.device)
        total = torch.stack([per_param[n].float() if n in per_param else zero for n in self.names])
        if self.spread:
            dist.all_reduce(total)
        return total * self.weights


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2, tensor parallel); a plain tensor as it is."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
