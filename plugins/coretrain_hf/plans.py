"""``transformers-plans``: tensor parallelism for a transformers model that any provider returns.

A model of your own provider (``AutoModelForTokenClassification.from_pretrained(...)``, a
transformers model with your head) carries its architecture's plan, ``config.base_model_tp_plan``,
as ``from_pretrained(tp_plan="auto")`` reads it; this plugin answers the ``tensor-parallel``
plugin's ``tensor_parallel_plan`` with it after the provider (last: the ``hf`` provider and a
plan of yours come first). It is transformers' plain plan — attention and MLP projections
column-wise in, row-wise out, everything else whole on each rank — without the sequence
parallelism the ``hf`` provider adds: a batch of any length splits, padded or not.
"""

from __future__ import annotations

from typing import Any

import torch
from attrs import define

from coretrain import Run, UserError, hookimpl


def is_transformers_model(model: torch.nn.Module) -> bool:
    """A transformers ``PreTrainedModel`` (by its attributes: transformers is not imported for it)."""
    return hasattr(model, "base_model_prefix") and hasattr(getattr(model, "config", None), "model_type")


def refuse_adapters(model: torch.nn.Module, tp: int) -> None:
    """Transformers' plan splits plain Linear layers, not peft's: one error for a PeftModel."""
    if hasattr(model, "peft_config"):
        raise UserError(
            f"distributed.tp_size = {tp}: LoRA adapters (a PeftModel) are not split over "
            "tensor-parallel ranks; train them on data-parallel, FSDP, context- or pipeline-parallel ranks"
        )


@define
class TransformersPlans:
    """Transformers' own tensor-parallel plan for a transformers model from any provider."""

    @hookimpl(trylast=True)
    def tensor_parallel_plan(self, run: Run, model: torch.nn.Module) -> dict[str, Any] | None:
        from coretrain_hf.parallel import transformers_plan

        refuse_adapters(model, run.dist.tp_size)
        if not is_transformers_model(model):
            return None
        plan = transformers_plan(model.config, run.dist.tp_size)
        prefix = f"{model.base_model_prefix}."  # model.layers.0.self_attn.q_proj ...
        return {prefix + path: style for path, style in plan.items()} or None
