"""``lora``: low-rank adapters with ``peft``; only the adapters train.

    [plugins.lora]
    rank = 8
    alpha = 16
    dropout = 0.05
    target_modules = ["q_proj", "v_proj"]     # module names (suffixes), as peft matches them

    [checkpoint]
    save_frozen = false                        # checkpoints hold the adapters only

The model (the Hugging Face model inside the ``hf`` provider's wrapper, or any model) becomes
a ``peft`` model before compilation and parallel wrappers; every base parameter is frozen, so
the optimizer holds the adapters alone. ``coretrain checkpoint export RUN --format hf`` writes a
PEFT adapter directory (``PeftModel.from_pretrained(base, DIR)`` loads it), or with
``--merge-lora`` the base model with the adapters merged in (``from_pretrained(DIR)``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from attrs import define, field

from coretrain import Run, UserError, fraction, hookimpl, positive, require

log = logging.getLogger("coretrain")
NEEDED_BY = "plugins.lora"


@define(kw_only=True)
class LoRA:
    """Low-rank adapters (peft's LoRA) on the named modules; the base weights stay frozen."""

    rank: int = field(default=8, validator=positive)
    """Rank r of each adapter (A: r × in, B: out × r)."""
    alpha: float = field(default=16.0, validator=positive)
    """Scale: the adapter's update is multiplied by alpha / rank."""
    dropout: float = field(default=0.0, validator=fraction)
    """Dropout on the adapter's input."""
    target_modules: list[str] = field(factory=lambda: ["q_proj", "v_proj"])
    """Names of the modules to adapt (a name matches a module whose name ends with it)."""

    def peft_config(self) -> Any:
        peft = require("peft", needed_by=NEEDED_BY, extra="hf")
        return peft.LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(self.target_modules)
        )

    @hookimpl(tryfirst=True)
    def configure_model(self, run: Run) -> None:
        peft = require("peft", needed_by=NEEDED_BY, extra="hf")
        holder = run.model if hasattr(run.model, "hf") else None  # the hf provider's wrapper
        base: Any = holder.hf if holder is not None else run.model
        try:
            adapted = peft.get_peft_model(base, self.peft_config())
        except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
            linear = {name.rsplit(".", 1)[-1] for name, m in base.named_modules() if isinstance(m, torch.nn.Linear)}
            names = ", ".join(sorted(linear))
            raise UserError(f"plugins.lora.target_modules: {exc}; the model's Linear modules: {names}") from None
        if holder is not None:
            holder.hf = adapted
        else:
            run.model = adapted
        trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in run.model.parameters())
        log.info("lora: %d of %d parameters train (%.2f%%)", trainable, total, 100 * trainable / total)
        if run.config.checkpoint.save and run.config.checkpoint.save_frozen and run.dist.is_main:
            log.info("lora: checkpoints hold the frozen base weights too; set checkpoint.save_frozen = false")


def export_adapters(model: Any, weights: dict[str, torch.Tensor], lora: LoRA, merge: bool) -> tuple[Any, str]:
    """The exported model: the base with the trained adapters, merged into it or kept as a PEFT adapter."""
    peft = require("peft", needed_by="checkpoint export --format hf", extra="hf")
    adapted = peft.get_peft_model(model, lora.peft_config())
    result = adapted.load_state_dict(weights, strict=False)
    adapters = [name for name, _ in adapted.named_parameters() if "lora_" in name]
    missing = [name for name in result.missing_keys if "lora_" in name]
    if result.unexpected_keys or missing or not adapters:
        raise UserError(
            "the checkpoint's adapters do not fit plugins.lora's settings: "
            f"missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}"
        )
    if merge:
        return adapted.merge_and_unload(), "with the LoRA adapters merged"
    return adapted, "LoRA adapters (PEFT; load with PeftModel.from_pretrained(base, DIR))"
