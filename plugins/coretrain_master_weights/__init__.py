"""``master-weights``: the model's weights and gradients in bf16, an fp32 master copy in the
optimizer — Megatron's ``--bf16`` (its Float16OptimizerWithFloat16Params), for DDP and one rank.

The choice for a model that is not sharded (docs/guides/memory.md):

- ``run.precision = "bf16"`` alone is autocast: weights, gradients and optimizer state stay
  fp32 (16 bytes per parameter with Adam), matmuls run in bf16.
- with ``[plugins.master-weights]`` as well, weights and gradients are bf16 (half the memory,
  half the bytes DDP all-reduces) and the optimizer updates an fp32 copy (4 + 8 bytes with
  Adam), so an update smaller than bf16's resolution still accumulates: 12 + 2 + 2 bytes, and the
  gradient copy lives only during the update. Autocast stays on, so softmax, norms and the loss
  run in fp32 as before.

With FSDP2, the fsdp plugin's ``param_dtype = "bfloat16"`` is this (its sharded fp32 parameters
are the master copy, and ``reduce_dtype`` keeps reductions in fp32); this plugin refuses a
sharded model. Gradient clipping and DDP's all-reduce see the bf16 gradients.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from attrs import define

from coretrain import Run, UserError, hookimpl, is_sharded

log = logging.getLogger("coretrain")


class MasterWeightsOptimizer(torch.optim.Optimizer):
    """The run's optimizer, moved onto fp32 copies of the model's parameters: gradients are copied
    up before each update and the weights copied down after it. Checkpoints hold the copies (as
    ``master`` in each parameter's optimizer state), so a resumed run continues from fp32.

    Delegates rather than calling ``Optimizer.__init__``: the schedule, the loop and checkpoints
    see the wrapped optimizer's param groups and state. Written here rather than taken from a
    library: torchao's bf16 optimizers round stochastically instead of keeping a copy, and
    Megatron's is tied to its distributed optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner = optimizer
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for group in optimizer.param_groups:  # no update has run: the state is empty, swapping is safe
            masters = [param.detach().to(torch.float32, copy=True) for param in group["params"]]
            self.pairs.extend(zip(group["params"], masters, strict=True))
            group["params"] = masters
        self._share()

    def _share(self) -> None:
        """The wrapped optimizer's groups, state and defaults are this one's (the schedule sets
        rates on them); again after ``load_state_dict``, which replaces them."""
        self.param_groups, self.state, self.defaults = self.inner.param_groups, self.inner.state, self.inner.defaults

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        for weight, master in self.pairs:
            master.grad = None if weight.grad is None else weight.grad.to(torch.float32)
        loss = self.inner.step(closure)
        for weight, master in self.pairs:
            weight.copy_(master)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for weight, master in self.pairs:
            master.grad = None
            if set_to_none or weight.grad is None:
                weight.grad = None
            else:
                weight.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        saved = self.inner.state_dict()
        moments = saved["state"]  # its dicts are the live state: add the copies to new ones
        saved["state"] = {i: {**moments.get(i, {}), "master": master} for i, (_, master) in enumerate(self.pairs)}
        return saved

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        moments = {index: dict(values) for index, values in state_dict["state"].items()}
        masters = {index: values.pop("master") for index, values in moments.items() if "master" in values}
        self.inner.load_state_dict({**state_dict, "state": {i: v for i, v in moments.items() if v}})
        self._share()
        if len(masters) < len(self.pairs):
            log.warning(
                "master-weights: the checkpoint's optimizer state has no fp32 master weights (saved without "
                "this plugin): they start from the model's bf16 weights"
            )
        for index, (weight, master) in enumerate(self.pairs):
            master.copy_(masters[index] if index in masters else weight)
            weight.copy_(master)


@define(kw_only=True)
class MasterWeights:
    """bf16 weights and gradients; the optimizer updates an fp32 master copy (Megatron's --bf16)."""

    @hookimpl(tryfirst=True)
    def configure_model(self, run: Run) -> None:
        if run.config.run.precision != "bf16":
            raise UserError(
                f'plugins.master-weights: run.precision is "{run.config.run.precision}"; bf16 weights need '
                'run.precision = "bf16" (autocast keeps softmax, norms and the loss in fp32)'
            )
        run.model.to(torch.bfloat16)  # before DDP wraps it: gradients and their all-reduce in bf16

    @hookimpl
    def configure_optimizer(self, run: Run) -> None:
        if is_sharded(run.model):
            raise UserError(
                "plugins.master-weights: the model is sharded (fsdp or tensor parallel), whose parameters are "
                'already the fp32 master copy: use [plugins.fsdp] param_dtype = "bfloat16" instead'
            )
        run.optimizer = MasterWeightsOptimizer(run.optimizer)
        count = sum(master.numel() for _, master in run.optimizer.pairs)
        log.info("master-weights: bf16 weights, fp32 master copy of %d parameters in the optimizer", count)
