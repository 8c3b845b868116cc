"""``lora``: low-rank adapters with ``peft``; only the adapters train.

    [plugins.lora]
    rank = 8
    alpha = 16
    dropout = 0.05
    target_modules = ["q_proj", "v_proj"]     # module names (suffixes), as peft matches them
    modules_to_save = []                       # modules that train in full besides the adapters
    base_weights = "runs/base"                 # a model of yours trained without adapters (its run)

    [checkpoint]
    save_frozen = false                        # checkpoints hold the adapters only

The model (the Hugging Face model inside the ``hf`` provider's wrapper, or any model) becomes
a ``peft`` model before compilation and parallel wrappers; every base parameter is frozen, so
the optimizer holds the adapters alone — and a new head: a transformers classifier (sequence or
token classification, question answering) is given peft's task, so its randomly initialised
``score`` / ``classifier`` / ``qa_outputs`` trains in full and is saved with the adapters, as
peft's own ``task_type="SEQ_CLS"`` fine-tuning does (``modules_to_save`` names the head of a
model of yours). ``coretrain checkpoint export RUN --format hf`` writes a
PEFT adapter directory (``PeftModel.from_pretrained(base, DIR)`` loads it), or with
``--merge-lora`` the base model with the adapters merged in (``from_pretrained(DIR)``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from attrs import define, field

from coretrain import (
    Run,
    UserError,
    find_checkpoint,
    fraction,
    hookimpl,
    positive,
    read_manifest,
    read_weights,
    require,
    step_dirs,
)

log = logging.getLogger("coretrain")
NEEDED_BY = "plugins.lora"
PEFT_TASKS = {
    "ForSequenceClassification": "SEQ_CLS",
    "ForTokenClassification": "TOKEN_CLS",
    "ForQuestionAnswering": "QUESTION_ANS",
}
"""peft's task for a transformers model by its class's ending: those whose head is new."""


def peft_task(model: torch.nn.Module) -> str | None:
    """peft's task for a model whose head the fine-tuning adds (a classifier): peft then trains
    and saves that head in full; ``None`` for a language model, whose head is pretrained."""
    name = type(model).__name__
    return next((task for ending, task in PEFT_TASKS.items() if name.endswith(ending)), None)


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
    modules_to_save: list[str] = field(factory=list)
    """Modules that train in full and are saved beside the adapters: a new head of your model
    (``["fc"]``). A transformers classifier's head is added by peft itself."""
    base_weights: str | None = None
    """The weights the model takes before the adapters are added: a coretrain run directory (its
    newest complete checkpoint), a checkpoint directory or a ``.safetensors`` file — a base of your
    own model trained without adapters (the ``hf`` provider's ``path`` is the base already).
    Read at every start, so a resume of adapters saved alone (``checkpoint.save_frozen = false``)
    gets its base again. ``checkpoint.pretrained`` loads into the adapted model, whose parameters
    peft has renamed (``base_model.model....base_layer.weight``): a LoRA run's checkpoint."""

    def peft_config(self, model: torch.nn.Module) -> Any:
        """peft's LoRA settings for ``model`` (its task decides which head trains in full)."""
        peft = require("peft", needed_by=NEEDED_BY, extra="hf")
        return peft.LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=list(self.target_modules),
            modules_to_save=list(self.modules_to_save) or None,
            task_type=peft_task(model),
        )

    def check_modules_to_save(self, model: torch.nn.Module) -> None:
        """Each of ``modules_to_save`` names a module of ``model`` (peft would skip a name that
        matches none, and the head it meant would stay frozen)."""
        paths = [f".{path}" for path, _ in model.named_modules()]
        unmatched = [name for name in self.modules_to_save if not any(path.endswith(f".{name}") for path in paths)]
        if unmatched:
            children = ", ".join(name for name, _ in model.named_children())
            raise UserError(
                f"plugins.lora.modules_to_save: no module named {unmatched} in the model; its modules: {children}"
            )

    @hookimpl(tryfirst=True)
    def configure_model(self, run: Run) -> None:
        peft = require("peft", needed_by=NEEDED_BY, extra="hf")
        holder = run.model if hasattr(run.model, "hf") else None  # the hf provider's wrapper
        base: Any = holder.hf if holder is not None else run.model
        if self.base_weights is not None:  # into the model as its provider made it: the checkpoint's names
            load_base(run.model, Path(self.base_weights))
        check_pretrained_has_adapters(run)
        self.check_modules_to_save(base)
        try:
            adapted = peft.get_peft_model(base, self.peft_config(base))
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


def checkpoint_at(path: Path, option: str) -> Path:
    """The checkpoint ``path`` names: itself, or a run's (or its ``checkpoints/``) newest complete one."""
    if (path / "checkpoint.json").is_file():
        return path
    return find_checkpoint(path / "checkpoints" if (path / "checkpoints").is_dir() else path, None, option)


def check_pretrained_has_adapters(run: Run) -> None:
    """``checkpoint.pretrained`` of a run trained without adapters — a base — would not fit the
    adapted model, whose parameters peft renames (every name missing): say what names a base.
    A run that resumes does not load it, and another loop's file says nothing of adapters."""
    pretrained = run.config.checkpoint.pretrained
    resumes = any(committed for _, committed, _ in step_dirs(run.output_dir / "checkpoints"))
    if pretrained is None or resumes or not Path(pretrained).is_dir():
        return
    saved = read_manifest(checkpoint_at(Path(pretrained), "checkpoint.pretrained")).get("config")
    if saved is not None and "lora" not in (saved.get("plugins") or {}):  # (a manifest without it says nothing)
        raise UserError(
            f"checkpoint.pretrained: {pretrained} was trained without LoRA adapters, and this run's model has "
            f"peft's names: it is the base, [plugins.lora] base_weights = {json.dumps(pretrained)}"
        )


def load_base(model: torch.nn.Module, path: Path) -> None:
    """``base_weights`` into ``model``: every parameter, each of its shape, or one error naming those that differ."""
    where = "plugins.lora.base_weights"
    if not path.exists():
        raise UserError(f"{where}: {path} does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        weights = load_file(path)
    else:
        weights = read_weights(checkpoint_at(path, where))
    own = model.state_dict()
    missing = [name for name in own if name not in weights]
    extra = [name for name in weights if name not in own]
    shapes = [name for name, value in own.items() if name in weights and weights[name].shape != value.shape]
    if missing or extra or shapes:
        raise UserError(
            f"{where}: {path} does not fit the model (as its provider builds it, without adapters): "
            f"missing {missing[:3]}, not in the model {extra[:3]}, other shapes {shapes[:3]}"
        )
    model.load_state_dict(weights)


def export_adapters(model: Any, weights: dict[str, torch.Tensor], lora: LoRA, merge: bool) -> tuple[Any, str]:
    """The exported model: the base with the trained adapters, merged into it or kept as a PEFT adapter."""
    peft = require("peft", needed_by="checkpoint export --format hf", extra="hf")
    adapted = peft.get_peft_model(model, lora.peft_config(model))
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
