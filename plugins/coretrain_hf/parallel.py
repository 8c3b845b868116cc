"""The hf provider's tensor-parallel plan: transformers' own ``base_model_tp_plan`` for the
architecture, made sequence-parallel where the decoder layers are Llama-shaped.

Transformers' plan splits the attention and MLP projections (column-wise in, row-wise out) and
leaves everything else whole. Sequence parallelism (Megatron's, torchtitan's) also splits the
residual stream between them by position: each rank of the group holds 1/tp of the sequence
for the norms, the row-wise outputs are reduce-scattered onto it instead of all-reduced, and
the attention and MLP gather it back. It starts inside the first layer, after the model has
built positions and the causal mask for the whole sequence, and ends before the final norm,
so the head and the loss see every position. Layers of another shape get the plain plan.
"""

from __future__ import annotations

from typing import Any

import torch

from coretrain import UserError

SEQUENCE_PARALLEL_LAYER = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
"""The submodules a decoder layer needs for the sequence-parallel plan (Llama, Mistral, Qwen2…)."""


def transformers_plan(config: Any, tp: int) -> dict[str, Any]:
    """``base_model_tp_plan`` as DTensor styles, after checking that ``tp`` divides the heads."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, str] = dict(getattr(config, "base_model_tp_plan", None) or {})
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    unknown = sorted({style for style in plan.values() if style not in styles})
    if unknown:
        raise UserError(
            f"model.options: the {config.model_type} tensor-parallel plan of transformers uses "
            f"{', '.join(unknown)}, which coretrain does not map; give the plan in "
            "[plugins.tensor-parallel] plan (colwise, rowwise, colwise_replicate, embedding)"
        )
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        size = getattr(config, key, None)
        if isinstance(size, int) and size % tp:
            raise UserError(f"distributed.tp_size ({tp}) must divide the model's {key} ({size})")
    return {path: styles[style]() for path, style in plan.items()}


def sequence_parallel(base: torch.nn.Module, plan: dict[str, Any], tp: int, seq_length: int | None) -> dict[str, Any]:
    """``plan`` with the residual stream split by position, if every layer is Llama-shaped."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers) or not hasattr(base, "norm"):
        return plan
    if not all(hasattr(layer, name) for layer in layers for name in SEQUENCE_PARALLEL_LAYER):
        return plan
    if seq_length and seq_length % tp:
        raise UserError(f"distributed.tp_size ({tp}) must divide the sequence length ({seq_length})")
    positions, whole = (Shard(1),), (Replicate(),)
    rowwise = {path for path, style in plan.items() if isinstance(style, RowwiseParallel)}
    return {
        **plan,
        **{path: RowwiseParallel(output_layouts=Shard(1)) for path in rowwise},  # reduce-scatter
        "layers.0": PrepareModuleInput(  # the whole sequence in, this rank's positions on
            input_layouts=whole, desired_input_layouts=positions, use_local_output=True
        ),
        "layers.*.input_layernorm": SequenceParallel(),
        "layers.*.self_attn": PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
        ),
        "layers.*.post_attention_layernorm": SequenceParallel(),
        "layers.*.mlp": PrepareModuleInput(input_layouts=positions, desired_input_layouts=whole),
        # every position for the final norm, the head and the loss
        "norm": PrepareModuleInput(input_layouts=positions, desired_input_layouts=whole, use_local_output=True),
    }
