"""The GPT's tensor-parallel plan (torchtitan's, for this model), with a mixture of experts'
experts split as Megatron's expert tensor parallelism splits them."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from coretrain_gpt.moe import Experts, TensorSplit


def tensor_parallel_plan(model: Any, with_experts: bool, experts_spread: bool) -> dict[str, Any]:
    """Attention heads and the MLP's hidden units split over the group (column-wise in, row-wise
    out), the vocabulary split in the embedding and the tied output head, and the norms and
    residual stream sequence-parallel (each rank holds 1/tp of the positions between the
    attention and MLP blocks). A mixture of experts takes the whole sequences (gathered): every
    rank routes every token the same way, and each holds a share of every expert's hidden units
    (``experts_spread``: expert parallelism already placed them) and of the shared experts'."""
    gather_positions = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan: dict[str, Any] = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "drop": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        "blocks.*.ln_1": SequenceParallel(),
        "blocks.*.attn": gather_positions,
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.ln_2": SequenceParallel(),
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    if not with_experts:
        plan |= {
            "blocks.*.mlp": gather_positions,
            "blocks.*.mlp.fc": ColwiseParallel(),
            "blocks.*.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        }
    else:
        plan |= {
            "blocks.*.mlp": PrepareModuleInputOutput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_input=True,
                output_layouts=(Replicate(),),
                desired_output_layouts=(Shard(1),),
            ),
            "blocks.*.mlp.experts": ExpertTensorParallel(experts_spread),
        }
        if any(name.endswith("mlp.shared") for name, _ in model.named_modules()):
            plan |= {"blocks.*.mlp.shared.fc": ColwiseParallel(), "blocks.*.mlp.shared.proj": RowwiseParallel()}
    present = {name for name, _ in model.named_modules()}  # a pipeline stage holds some of them
    return {key: style for key, style in plan.items() if "*" in key or key in present}


class ExpertTensorParallel(ParallelStyle):
    """Each rank of the group holds a share of every expert's hidden units
    (:attr:`Experts.TENSOR_SPLIT`), computes its share of each row's output and sums it with the
    others' (:class:`TensorSplit`). ``spread``: expert parallelism already placed the weights on
    its (experts × tensor) mesh, with the same split."""

    def __init__(self, spread: bool) -> None:
        super().__init__()
        self.spread = spread

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        assert isinstance(module, Experts), module
        if not self.spread:
            for name, param in list(module.named_parameters()):
                dim = Experts.TENSOR_SPLIT[name]
                placement = Replicate() if dim is None else Shard(dim)
                owner, _, attribute = name.rpartition(".")
                split = nn.Parameter(distribute_tensor(param.detach(), device_mesh, [placement]))
                setattr(module.get_submodule(owner), attribute, split)
        module.tensor_split = TensorSplit(device_mesh.get_group())
        return module
