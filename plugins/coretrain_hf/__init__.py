"""``hf``: a Hugging Face ``transformers`` model as coretrain's model, and back out.

    [model]
    provider = "hf"
    [model.options]
    path = "models/tiny-llama"          # a local save_pretrained directory
    # or, for a randomly initialised model:
    # config = { model_type = "llama", hidden_size = 256, num_hidden_layers = 4, ... }
    task = "causal-lm"                  # or "sequence-classification", "token-classification", "seq2seq-lm",
                                        # "masked-lm"
    dtype = "float32"

Labels are shifted exactly once, whatever the data provider sends (:mod:`coretrain_hf.model`).
``coretrain checkpoint export RUN_DIR --format hf --to DIR`` writes a directory that
``AutoModelForCausalLM.from_pretrained(DIR)`` loads (:mod:`coretrain_hf.export`). Nothing is
downloaded: ``path`` is read with ``local_files_only``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import torch
from attrs import define, field
from coretrain_tokenizer import REMOTE_CODE, padded_vocab, remote_code_refused

from coretrain import FieldValueError, Run, UserError, hookimpl, positive, require

TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "masked-lm": "AutoModelForMaskedLM",
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NEEDED_BY = 'model.provider = "hf"'


def refuse_a_saved_model_as_pretrained(pretrained: str | None, path: str | None) -> None:
    """``checkpoint.pretrained`` naming what ``save_pretrained`` wrote — its directory (a downloaded
    model, an hf export), or a ``.safetensors`` file in it, named without this provider's ``hf.`` —
    failed as a coretrain checkpoint ("model.pt: checkpoint file missing", or every name missing):
    this provider loads such a directory, through ``path``."""
    if pretrained is None:
        return
    given = Path(pretrained)
    weights_file = given.suffix == ".safetensors"
    directory = given.parent if weights_file else given
    coretrains = (directory / "checkpoint.json").is_file() or (directory / "checkpoints").is_dir()
    if coretrains or not (directory / "config.json").is_file():
        return
    if weights_file and not transformers_names(given):
        return  # this provider's own export (its names start with hf.): it fits
    loads_it = "model.options.path loads it: remove checkpoint.pretrained"
    if path is None or Path(path).resolve() != directory.resolve():
        loads_it = f"the hf provider loads it: [model.options] path = {json.dumps(str(directory))}"
    raise UserError(
        f"checkpoint.pretrained: {pretrained} is a Hugging Face model's save (config.json), not a coretrain "
        f"checkpoint; {loads_it} (with ignore_mismatched_sizes = true for a head of another shape)"
    )


def transformers_names(weights: Path) -> bool:
    """Whether a ``.safetensors`` file names its tensors as transformers does (not one of this
    provider's exports: ``hf.model...``); False when it cannot be read (the load says why)."""
    from safetensors import safe_open

    try:
        with safe_open(str(weights), "pt") as opened:
            names = list(opened.keys())
    except Exception:  # a damaged or foreign file: the checkpoint loader names what is wrong
        return False
    return bool(names) and not any(name.startswith("hf.") for name in names)


@define(kw_only=True)
class HFModel:
    """A Hugging Face transformers model: from a local directory, or a config table (random init)."""

    path: str | None = None
    """A local ``save_pretrained`` directory (config.json + safetensors, sharded or not)."""
    config: dict[str, Any] = field(factory=dict)
    """Config fields: with ``path``, overrides of its config; without, the whole config of a
    randomly initialised model (``model_type`` required; vocab_size and
    max_position_embeddings default to the data's)."""
    task: Literal["causal-lm", "sequence-classification", "token-classification", "seq2seq-lm", "masked-lm"] = (
        "causal-lm"
    )
    """What the model is trained for: the next token, a class per text, a class per token (a
    tagger), a target text from a source text (an encoder-decoder: T5, BART), or the masked
    tokens of a text (BERT's pretraining; the data's collate masks them)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype (mixed precision is run.precision's job; this stores the weights so)."""
    num_labels: int | None = field(default=None, validator=positive)
    """Classes, for sequence- and token-classification (unset = the model config's)."""
    ignore_mismatched_sizes: bool = False
    """Layers of ``path`` whose shapes differ from the model's — a classifier's head for another
    ``num_labels`` — start from a fresh initialisation instead of being an error (transformers'
    ``from_pretrained(..., ignore_mismatched_sizes=True)``, as a fine-tuning script passes it)."""
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    """Attention kernel: PyTorch's scaled_dot_product_attention, or the reference one."""
    make_vocab_size_divisible_by: int | None = field(default=None, validator=positive)
    """A new model's (``config``) vocabulary, the data's, padded up to a multiple of this ×
    tp_size, as Megatron pads it (128 there); unset: the data's as it is."""

    def __attrs_post_init__(self) -> None:
        if self.path is None and not self.config:
            raise FieldValueError("path", 'set path (a save_pretrained directory) or config = { model_type = "..." }')
        if self.path is None and "model_type" not in self.config:
            raise FieldValueError("config", 'needs model_type, e.g. config = { model_type = "llama", ... }')

    @hookimpl
    def provide_model(self, run: Run) -> torch.nn.Module:
        from coretrain_hf.model import CausalLM, Seq2SeqLM, SequenceClassifier, TokenClassifier

        refuse_a_saved_model_as_pretrained(run.config.checkpoint.pretrained, self.path)
        transformers = require("transformers", needed_by=NEEDED_BY, extra="hf")
        transformers.utils.logging.disable_progress_bar()  # coretrain shows its own progress
        trusted = run.config.tokenizer.trust_remote_code
        vocab = run.datasets.vocab_size
        if vocab and self.path is None:
            vocab = padded_vocab(vocab, self.make_vocab_size_divisible_by, run.dist.tp_size)
        config = self.model_config(vocab, run.datasets.seq_length, trusted)
        auto = getattr(transformers, TASKS[self.task])
        options: dict[str, Any] = {"dtype": DTYPES[self.dtype], "attn_implementation": self.attn_implementation}
        options["trust_remote_code"] = trusted
        try:
            if self.path is not None:
                hf = auto.from_pretrained(
                    self.path,
                    config=config,
                    local_files_only=True,
                    ignore_mismatched_sizes=self.ignore_mismatched_sizes,
                    **options,
                )
            else:
                hf = auto.from_config(config, **options)
        except (OSError, ValueError, KeyError) as exc:
            raise UserError(f"model.options: transformers cannot build the model: {exc}") from None
        except RuntimeError as exc:
            if "ignore_mismatched_sizes" not in str(exc):
                raise
            raise UserError(
                f"model.options.path: weights in {self.path} do not fit the model (transformers' load report "
                "above names them; a classifier's head for another num_labels): set "
                "model.options.ignore_mismatched_sizes = true to initialise those afresh"
            ) from None
        check_vocab(hf.config, run.datasets.vocab_size)
        if run.config.distributed.ep_size > 1:  # its experts spread over ranks by expert-parallel
            from coretrain_hf.experts import make_routable, stacked_experts

            for experts in stacked_experts(hf):
                make_routable(experts)
        if self.task == "causal-lm":
            return CausalLM(hf, run.datasets.seq_length)
        if self.task == "seq2seq-lm":
            return Seq2SeqLM(hf)
        per_position = self.task in ("token-classification", "masked-lm")  # a class, or a token, per position
        return TokenClassifier(hf) if per_position else SequenceClassifier(hf)

    def model_config(
        self, vocab_size: int | None = None, seq_length: int | None = None, trust_remote_code: bool = False
    ) -> Any:
        """The transformers config this plugin's options describe (``trust_remote_code``: a custom
        architecture's code in ``path`` may run: ``[tokenizer] trust_remote_code``)."""
        transformers = require("transformers", needed_by=NEEDED_BY, extra="hf")
        fields = dict(self.config)
        if self.num_labels is not None:
            fields["num_labels"] = self.num_labels
        try:
            if self.path is not None:
                directory = Path(self.path)
                if not (directory / "config.json").is_file():
                    raise UserError(
                        f"model.options.path: {directory} has no config.json; give a directory written by "
                        "save_pretrained (downloaded models: the snapshot directory)"
                    )
                return transformers.AutoConfig.from_pretrained(
                    directory, local_files_only=True, trust_remote_code=trust_remote_code, **fields
                )
            model_type = fields.pop("model_type")
            if vocab_size:
                fields.setdefault("vocab_size", vocab_size)
            if seq_length:
                fields.setdefault("max_position_embeddings", seq_length)
            return transformers.AutoConfig.for_model(model_type, **fields)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            if REMOTE_CODE in str(exc) and not trust_remote_code and self.path is not None:
                raise UserError(remote_code_refused("model.options.path", Path(self.path), "model")) from None
            raise UserError(f"model.options.config: {exc}") from None

    @hookimpl
    def pipeline_blocks(self) -> int | None:
        """The decoder layers a pipeline cuts (``num_hidden_layers``, of the config table or the
        model directory's config.json), for the split's check before any rank starts."""
        layers = self.config.get("num_hidden_layers")
        if layers is None and self.path is not None:
            try:
                layers = json.loads((Path(self.path) / "config.json").read_text()).get("num_hidden_layers")
            except (OSError, ValueError, AttributeError):
                return None  # the build says what is wrong with it
        return layers if isinstance(layers, int) else None

    @hookimpl
    def tensor_parallel_plan(self, run: Run, model: torch.nn.Module) -> dict[str, Any] | None:
        """Transformers' own plan for the architecture (its config's ``base_model_tp_plan``, what
        ``from_pretrained(tp_plan="auto")`` applies), sequence-parallel where the layers allow
        (:mod:`coretrain_hf.parallel`). None for an architecture without a plan."""
        from coretrain_hf.model import wrapped_model
        from coretrain_hf.parallel import sequence_parallel, transformers_plan
        from coretrain_hf.transformers_models import refuse_adapters

        hf = wrapped_model(model)
        refuse_adapters(hf, run.dist.tp_size)
        plan = transformers_plan(getattr(hf, "config", None), run.dist.tp_size)
        if not plan:
            return None
        base = getattr(hf, hf.base_model_prefix)
        plan = sequence_parallel(base, plan, run.dist.tp_size, run.datasets.seq_length)
        if "layers.0" in plan and hf is not model:  # positions split over the group: a batch's are padded to fit
            wrapper: Any = model  # coretrain_hf.model's CausalLM or a classifier
            wrapper.position_multiple = run.dist.tp_size
        prefix = ("hf." if hf is not model else "") + f"{hf.base_model_prefix}."  # hf.model.layers.0...
        return {prefix + path: style for path, style in plan.items()}

    @hookimpl
    def expert_layers(self, model: torch.nn.Module) -> list[Any] | None:
        """Transformers' stacked experts this provider made routable (it does when the model is
        built with ep_size > 1), in the whole model or in the pipeline stages a rank holds."""
        from coretrain_hf.experts import stacked_experts

        return [experts for experts in stacked_experts(model) if hasattr(experts, "dispatch")] or None

    @hookimpl
    def pipeline_split(self, run: Run, model: torch.nn.Module) -> dict[str, Any] | None:
        """Llama-shaped causal LMs by decoder layer (:mod:`coretrain_hf.stages`)."""
        from coretrain_hf.model import CausalLM
        from coretrain_hf.stages import pipeline_split

        return pipeline_split(model) if isinstance(model, CausalLM) else None

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        if run.dist.is_main:
            from coretrain_hf.export import save_config
            from coretrain_hf.model import wrapped_model

            save_config(wrapped_model(run.unwrapped_model), run.output_dir)

    @hookimpl
    def predict_step(self, run: Run, batch: Any, options: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Texts (``coretrain predict --data``) answered as the pipeline for the task answers them
        (:func:`coretrain_hf.generate.answer_texts`), the tokenizer from ``path`` when the run names none."""
        if not (isinstance(batch, dict) and "prompt" in batch):
            return None
        from coretrain_hf.generate import answer_texts

        return answer_texts(run, self.path, batch, options)

    @hookimpl
    def export_model(
        self,
        state: dict[str, torch.Tensor],
        config: dict[str, Any],
        run_dir: Path,
        export_format: str,
        to: Path,
        options: dict[str, Any],
    ) -> str | None:
        if export_format != "hf":
            return None
        from coretrain_hf.export import save_pretrained

        return save_pretrained(self, state, config, run_dir, to, options)


def check_vocab(config: Any, data_vocab: int | None) -> None:
    """Token ids the data can produce must index the model's embeddings."""
    if data_vocab and getattr(config, "vocab_size", None) and data_vocab > config.vocab_size:
        raise UserError(
            f"model.options: the data's vocab_size ({data_vocab}) exceeds the model's ({config.vocab_size}); "
            "use the model's own tokenizer, or set config = { vocab_size = ... } for a new model"
        )
