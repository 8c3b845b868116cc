"""``model-stats``: the parameter norm and the number of zero gradients, at log steps only.

Megatron's ``--log-params-norm`` and ``--log-num-zeros-in-grad``. Each costs a pass over the
parameters, so it runs on the last step of each log interval and nowhere else: the zero count
right before that step's update (the gradients the optimizer is about to use), the norm right
after it (the weights the logged loss leads to). Both stay on the device in
``run.log_tensors`` until the loop's one host sync of the interval. Under FSDP the local
shards are summed and all-reduced once, so the figures are the whole model's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from attrs import define

from coretrain import Run, hookimpl, is_sharded


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor shard (FSDP2)
    return to_local() if to_local is not None else tensor


def _whole_model(value: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """A sum over this rank's parameters -> over the model's (FSDP: each rank holds a shard)."""
    if is_sharded(model):
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def param_norm(model: torch.nn.Module) -> torch.Tensor:
    """L2 norm over all parameters."""
    squares = torch.stack([_local(p.detach()).float().pow(2).sum() for p in model.parameters()]).sum()
    return _whole_model(squares, model).sqrt()


def zero_grads(model: torch.nn.Module) -> torch.Tensor:
    """How many gradient entries are exactly zero (dead units, masked or unused parameters)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    count = torch.stack([(_local(g) == 0).sum() for g in grads]).sum().float()
    return _whole_model(count, model)


@define(kw_only=True)
class ModelStats:
    """params_norm and zero_grads in the logged metrics, measured once per log interval."""

    param_norm: bool = True
    """Log ``params_norm``, the L2 norm of all parameters after the update."""
    zero_grads: bool = True
    """Log ``zero_grads``, the number of exactly-zero gradient entries before the update."""

    @hookimpl
    def before_update(self, run: Run, step: int) -> None:
        if self.zero_grads and step % run.config.train.log_interval == 0:
            run.log_tensors["zero_grads"] = zero_grads(run.model)

    @hookimpl
    def post_step(self, run: Run, step: int) -> None:
        if self.param_norm and step % run.config.train.log_interval == 0:
            with torch.no_grad():
                run.log_tensors["params_norm"] = param_norm(run.model)
