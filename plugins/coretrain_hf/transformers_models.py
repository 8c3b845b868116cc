"""``transformers-models``: what the ``hf`` provider gives its models, for a transformers model
that any provider returns — a provider of yours (``AutoModelForTokenClassification.from_pretrained``,
a transformers body with your head) keeps what transformers ships with the architecture:

- **tensor parallelism**: the model's own plan, ``config.base_model_tp_plan`` (what
  ``from_pretrained(tp_plan="auto")`` reads), answers the ``tensor-parallel`` plugin's
  ``tensor_parallel_plan`` after the provider (last: the ``hf`` provider and a plan of yours come
  first): attention and MLP projections column-wise in, row-wise out, everything else whole on
  each rank — without the sequence parallelism the ``hf`` provider adds, so a batch of any
  length splits, padded or not;
- **``checkpoint export --format hf``**: the run records the model's config and class at its
  start (``RUN_DIR/hf-config``); the export builds that transformers class from it, loads the
  checkpoint's weights strictly and writes ``save_pretrained``'s directory (the run's tokenizer
  copied in), which ``from_pretrained`` loads as the model you trained; with ``lora``, the
  adapters as a PEFT directory, or merged into the base when the checkpoint holds it;
- **every labelled token weighing the same** across micro-batches and ranks
  (:mod:`coretrain_hf.token_counts`: the ``Trainer``'s ``num_items_in_batch``);
- **``coretrain predict --data texts.jsonl``**: what transformers' pipelines answer for the
  model's kind — a classifier's class, a tagger's class per token, a masked LM's masks filled,
  ``generate``'s text for a causal LM or an encoder-decoder (T5, BART) — as for the ``hf``
  provider's models.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from attrs import define

from coretrain import Run, UserError, hookimpl, require
from coretrain_hf.model import adapted_model


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


def transformers_class(model: torch.nn.Module) -> str:
    """The transformers class of ``model`` (FSDP2 makes ``FSDPLlamaFor...`` of ``LlamaFor...``)."""
    return next(cls.__name__ for cls in type(model).__mro__ if cls.__module__.startswith("transformers."))


@define
class TransformersModels:
    """A transformers model from any provider: its architecture's tensor-parallel plan, ``--format hf``."""

    @hookimpl(trylast=True)
    def tensor_parallel_plan(self, run: Run, model: torch.nn.Module) -> dict[str, Any] | None:
        from coretrain_hf.parallel import transformers_plan

        refuse_adapters(model, run.dist.tp_size)
        if not is_transformers_model(model):
            return None
        plan = transformers_plan(model.config, run.dist.tp_size)
        prefix = f"{model.base_model_prefix}."  # model.layers.0.self_attn.q_proj ...
        return {prefix + path: style for path, style in plan.items()} or None

    @hookimpl(trylast=True)
    def configure_model(self, run: Run) -> None:
        """A transformers model says how many tokens its loss is over (the one a PeftModel adapts
        is called through it): the loop weighs each token of a step alike."""
        from coretrain_hf.token_counts import count_tokens

        if is_transformers_model(run.unwrapped_model):
            count_tokens(run.unwrapped_model)

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        """Rank 0 records the config and class of a transformers model (the one a PeftModel adapts)."""
        from coretrain_hf.export import CONFIG_DIR

        model = adapted_model(run.unwrapped_model)
        if run.dist.is_main and is_transformers_model(model):
            config: Any = copy.deepcopy(model.config)
            config.architectures = [transformers_class(model)]
            config.save_pretrained(run.output_dir / CONFIG_DIR)

    @hookimpl
    def predict_step(self, run: Run, batch: Any, options: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Texts to a transformers model a provider returned as it is (the ``hf`` provider's
        wrappers answer their own), as the pipeline for its kind answers them."""
        if not (isinstance(batch, dict) and "prompt" in batch and is_transformers_model(run.unwrapped_model)):
            return None
        from coretrain_hf.generate import answer_texts

        return answer_texts(run, None, batch, options)

    @hookimpl(trylast=True)
    def export_model(
        self,
        state: dict[str, torch.Tensor],
        config: dict[str, Any],
        run_dir: Path,
        export_format: str,
        to: Path,
        options: dict[str, Any],
    ) -> str | None:
        from coretrain_hf.export import CONFIG_DIR

        saved = run_dir / CONFIG_DIR
        if export_format != "hf" or not (saved / "config.json").is_file():
            return None
        return save_transformers_model(state, config, saved, to, options)


def save_transformers_model(
    state: dict[str, torch.Tensor], config: dict[str, Any], saved: Path, to: Path, options: dict[str, Any]
) -> str:
    """The class the run recorded in ``saved``, built from its config, the weights loaded
    strictly, written by ``save_pretrained`` (a class not in transformers is one error: its code
    is not the run directory's to name)."""
    from coretrain_hf.export import copy_preprocessing, refuse_used_destination, refusing_remote_code

    transformers = require("transformers", needed_by="checkpoint export --format hf", extra="hf")
    transformers.utils.logging.disable_progress_bar()
    refuse_used_destination(to)
    trusted = bool(options.get("trust_remote_code"))  # the user's flag; never the run directory's word
    with refusing_remote_code(saved, "model", trusted):
        hf_config = transformers.AutoConfig.from_pretrained(saved, local_files_only=True, trust_remote_code=trusted)
    name = (getattr(hf_config, "architectures", None) or ["?"])[0]
    model_class = getattr(transformers, name, None)
    if not isinstance(model_class, type) or not issubclass(model_class, transformers.PreTrainedModel):
        raise UserError(
            f"--format hf: the run's model class {name!r} (in {saved}/config.json) is not one of transformers'; "
            "export --format safetensors and load the weights into your class"
        )
    model, what = with_weights(model_class(hf_config), state, config, options)
    to.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(to)
    return f"wrote {to}: {name}{what}" + copy_preprocessing(config, to, trusted)


def with_weights(
    model: torch.nn.Module, state: dict[str, torch.Tensor], config: dict[str, Any], options: dict[str, Any]
) -> tuple[Any, str]:
    """``model`` with the checkpoint's weights: loaded strictly, or for a run of the ``lora``
    plugin its adapters, merged in or as a PEFT adapter directory. Adapters saved without their
    base (``checkpoint.save_frozen = false``) export as adapters only: the base your provider
    loaded is not the run directory's to name."""
    from coretrain_hf.export import load_strictly, lora_settings
    from coretrain_hf.lora import export_adapters

    lora = lora_settings(config)
    if lora is None:
        load_strictly(model, state)
        return model, ""
    merge = bool(options.get("merge_lora"))
    if merge and not config.get("checkpoint", {}).get("save_frozen", True):
        raise UserError(
            "--merge-lora: the checkpoint holds only the adapters (checkpoint.save_frozen = false) and your "
            "provider loaded the base: export the adapters (no --merge-lora) and merge them into your base "
            "with PeftModel.from_pretrained(base, DIR).merge_and_unload()"
        )
    adapted, what = export_adapters(model, state, lora, merge)
    return adapted, f" {what}"
