"""``model-stats``: the parameter norm, the number of zero gradients and (``layer_grad_norms``)
each block's gradient norm, at log steps only.

Megatron's ``--log-params-norm`` and ``--log-num-zeros-in-grad``. Each costs a pass over the
parameters, so it runs on the last step of each log interval and nowhere else: the zero count
right before that step's update (the gradients the optimizer is about to use), the norm right
after it (the weights the logged loss leads to). Both stay on the device in
``run.log_tensors`` until the loop's one host sync of the interval. With DTensor parameters
(FSDP2, tensor parallelism) each rank sums its local shards, weighted by how many ranks hold
the same elements, and one all-reduce gives the whole model's figures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from attrs import define

from coretrain import Run, blocks_of, hookimpl, is_sharded


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor shard (FSDP2, tensor parallel)
    return to_local() if to_local is not None else tensor


def _holders(tensor: torch.Tensor) -> int:
    """How many ranks hold each element of this rank's part: the ranks outside its mesh times
    the mesh dimensions it is replicated over (1 for a plain tensor: the sum stays local)."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return 1
    mesh = tensor.device_mesh  # type: ignore[attr-defined]
    replicated = math.prod(mesh.size(i) for i, placement in enumerate(placements) if placement.is_replicate())
    return int(dist.get_world_size() // mesh.size() * replicated)


def _whole_model(parts: Sequence[tuple[torch.Tensor, torch.Tensor]], model: torch.nn.Module) -> torch.Tensor:
    """Per-parameter sums over this rank's parts (value, the parameter) -> over the model's."""
    total = torch.stack([value / _holders(param) for value, param in parts]).sum()
    if is_sharded(model):
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total


def param_norm(model: torch.nn.Module) -> torch.Tensor:
    """L2 norm over all parameters."""
    params = list(model.parameters())
    return _whole_model([(_local(p.detach()).float().pow(2).sum(), p) for p in params], model).sqrt()


def zero_grads(model: torch.nn.Module) -> torch.Tensor:
    """How many gradient entries are exactly zero (dead units, masked or unused parameters)."""
    parts = [((_local(p.grad) == 0).sum().float(), p) for p in model.parameters() if p.grad is not None]
    if not parts:
        return torch.zeros(())
    return _whole_model(parts, model)


def layer_grad_norms(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each block's gradient L2 norm (``blocks_of``: a decoder layer, a ``gpt`` block) by its
    module name, and the rest's (embeddings, head) as ``other``: one all-reduce for all of them."""
    names = {id(module): name for name, module in model.named_modules()}
    groups: dict[str, list[torch.nn.Parameter]] = {names[id(b)]: list(b.parameters()) for b in blocks_of(model)}
    inside = {id(p) for params in groups.values() for p in params}
    groups["other"] = [p for p in model.parameters() if id(p) not in inside]
    device = next(model.parameters()).device

    def squared(params: list[torch.nn.Parameter]) -> torch.Tensor:
        parts = [_local(p.grad).float().pow(2).sum() / _holders(p) for p in params if p.grad is not None]
        return torch.stack(parts).sum() if parts else torch.zeros((), device=device)

    total = torch.stack([squared(params) for params in groups.values()])
    if is_sharded(model):
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return {f"grad_norm/{name}": norm for name, norm in zip(groups, total.sqrt().unbind(), strict=True)}


@define(kw_only=True)
class ModelStats:
    """params_norm and zero_grads in the logged metrics, measured once per log interval."""

    param_norm: bool = True
    """Log ``params_norm``, the L2 norm of all parameters after the update."""
    zero_grads: bool = True
    """Log ``zero_grads``, the number of exactly-zero gradient entries before the update."""
    layer_grad_norms: bool = False
    """Log ``grad_norm/BLOCK`` for each block (``grad_norm/blocks.3``, ``grad_norm/model.layers.3``)
    and ``grad_norm/other`` for the rest, before clipping, as ``grad_norm`` is — of the log step
    alone, where ``grad_norm`` is the interval's mean."""

    @hookimpl
    def before_update(self, run: Run, step: int) -> None:
        if not run.cadence.logs(step):
            return
        if self.zero_grads:
            run.log_tensors["zero_grads"] = zero_grads(run.model)
        if self.layer_grad_norms:
            run.log_tensors.update(layer_grad_norms(run.unwrapped_model))

    @hookimpl
    def post_step(self, run: Run, step: int) -> None:
        if self.param_norm and run.cadence.logs(step):
            with torch.no_grad():
                run.log_tensors["params_norm"] = param_norm(run.model)
