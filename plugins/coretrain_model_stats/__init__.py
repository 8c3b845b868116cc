"""``model-stats``: the parameter norm, the number of zero gradients and (``layer_grad_norms``)
each block's gradient norm, at log steps only.

Megatron's ``--log-params-norm`` and ``--log-num-zeros-in-grad``. Each costs a pass over the
parameters, so it runs on the last step of each log interval and nowhere else: the zero count
right before that step's update (the gradients the optimizer is about to use), the norm right
after it (the weights the logged loss leads to). Both stay on the device in
``run.log_tensors`` until the loop's one host sync of the interval. They are the whole model's
on every layout (:class:`coretrain_wholemodel.WholeModel`): with pipeline stages, FSDP2 or tensor-parallel
shards each rank sums its part, one all-reduce adds the parts with each element counted once
(a weight tied across stages once), and every rank logs what one rank would.
"""

from __future__ import annotations

import torch
from attrs import define, field
from coretrain_wholemodel import WholeModel

from coretrain import Run, hookimpl


def _local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)  # a DTensor shard (FSDP2, tensor parallel)
    return to_local() if to_local is not None else tensor


def param_norm(whole: WholeModel) -> torch.Tensor:
    """L2 norm over all parameters."""
    squares = {name: _local(p.detach()).float().pow(2).sum() for name, p in whole.params.items()}
    return whole.sums(squares).sum().sqrt()


def zero_grads(whole: WholeModel) -> torch.Tensor:
    """How many gradient entries are exactly zero (dead units, masked or unused parameters)."""
    zeros = {name: (_local(p.grad) == 0).sum() for name, p in whole.params.items() if p.grad is not None}
    return whole.sums(zeros).sum()


def layer_grad_norms(whole: WholeModel) -> dict[str, torch.Tensor]:
    """Each block's gradient L2 norm (``blocks_of``: a decoder layer, a ``gpt`` block) by its
    module name, and the rest's (embeddings, head) as ``other``: one all-reduce for all of them."""
    squares = {name: _local(p.grad).float().pow(2).sum() for name, p in whole.params.items() if p.grad is not None}
    per_param = whole.sums(squares)
    groups = sorted(set(whole.blocks), key=lambda name: (name == "other", name))
    index = {name: i for i, name in enumerate(groups)}
    per_block = torch.zeros(len(groups), device=per_param.device).index_add_(
        0, torch.tensor([index[b] for b in whole.blocks], device=per_param.device), per_param
    )
    return {f"grad_norm/{name}": norm for name, norm in zip(groups, per_block.sqrt().unbind(), strict=True)}


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
    _whole: WholeModel | None = field(default=None, init=False, repr=False)

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        """The whole model's parts, found once (every rank: a gather of names)."""
        self._whole = WholeModel(run)

    @hookimpl
    def before_update(self, run: Run, step: int) -> None:
        if not run.cadence.logs(step) or self._whole is None:
            return
        if self.zero_grads:
            run.log_tensors["zero_grads"] = zero_grads(self._whole)
        if self.layer_grad_norms:
            run.log_tensors.update(layer_grad_norms(self._whole))

    @hookimpl
    def post_step(self, run: Run, step: int) -> None:
        if self.param_norm and run.cadence.logs(step) and self._whole is not None:
            with torch.no_grad():
                run.log_tensors["params_norm"] = param_norm(self._whole)

    @hookimpl
    def on_train_end(self) -> None:
        self._whole = None  # it holds the run's parameters
