"""The run's one tokenizer, ``[tokenizer]``, loaded alike by every plugin that needs one.

    [tokenizer]
    path = "models/tiny-llama"        # a local save_pretrained directory; nothing is downloaded
    trust_remote_code = false         # true: run the code a custom tokenizer (or model) ships

Megatron's other tokenizer types (``[plugins.tokenizer] tokenizer_type``: GPT-2 vocab + merges,
SentencePiece, TikTokenizer, Null) are built as transformers tokenizers
(:mod:`coretrain_tokenizer.megatron`), so every provider below takes them as it takes a
directory. Their settings are the ``tokenizer`` plugin's table, as only it reads them::

    [tokenizer]
    path = "tokenizers/llama2.model"     # Megatron's tokenizer_model
    [plugins.tokenizer]
    tokenizer_type = "Llama2Tokenizer"

``hf-text``, ``hf-sft``, ``indexed``, ``predict`` and ``data prepare --config`` load their
tokenizer here; the ``tokenizer`` plugin (on by default) loads the run's once and hands it to
every data provider, a user's own too, as ``DatasetContext.tokenizer``.
A provider's own ``tokenizer`` option, where it has one, still works; named beside
``[tokenizer]`` it must name the same directory (a run has one tokenizer). The model's
vocabulary is padded as Megatron pads it by the model providers' ``make_vocab_size_divisible_by``
(:func:`padded_vocab`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from attrs import define, field

from coretrain import DatasetContext, Datasets, Run, UserError, hookimpl, positive, require

log = logging.getLogger("coretrain")

REMOTE_CODE = "trust_remote_code"
"""The word transformers' refusal to run a directory's own code contains."""


def tokenizer_directory(config: Any, own: str | None, own_key: str) -> tuple[str, str]:
    """The tokenizer directory a plugin loads, and the key that names it: the plugin's own
    option (``own``, at ``own_key``) or ``[tokenizer] path``; both set, they must agree."""
    shared = config.tokenizer.path
    if own is not None and shared is not None and Path(own).resolve() != Path(shared).resolve():
        raise UserError(
            f"{own_key} ({own}) and tokenizer.path ({shared}) name two tokenizers; a run has one: "
            "keep [tokenizer] path and drop the other"
        )
    if own is not None:
        return own, own_key
    if shared is not None:
        return shared, "tokenizer.path"
    raise UserError(f'{own_key}: no tokenizer: set [tokenizer] path = "DIR" (a local save_pretrained directory)')


def load_tokenizer(path: str, key: str, needed_by: str, trust_remote_code: bool = False) -> Any:
    """``AutoTokenizer`` from a local directory (nothing downloaded), or one error naming ``key``."""
    transformers = require("transformers", needed_by=needed_by, extra="hf")
    directory = Path(path)
    if not directory.is_dir():
        raise UserError(f"{key}: {directory} is not a directory (a saved tokenizer)")
    try:
        return transformers.AutoTokenizer.from_pretrained(
            directory, local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError) as exc:
        if REMOTE_CODE in str(exc) and not trust_remote_code:
            raise UserError(remote_code_refused(key, directory, "tokenizer")) from None
        raise UserError(f"{key}: cannot load a tokenizer from {directory}: {exc}") from None


def remote_code_refused(key: str, directory: Path, what: str) -> str:
    """The one line for a directory whose {what} runs code of its own, with the key that allows it."""
    return (
        f"{key}: the {what} in {directory} ships code of its own to run; set [tokenizer] "
        "trust_remote_code = true to run it (only for a directory you trust)"
    )


def run_tokenizer(run: Run, own: str | None, own_key: str, needed_by: str) -> tuple[Any, Path]:
    """The run's tokenizer (see :func:`tokenizer_directory`, or one of Megatron's types) and
    its directory (or file)."""
    kind = megatron_type(run.plugins.get("tokenizer"))
    if kind is not None:
        if own is not None:
            raise UserError(
                f"{own_key} ({own}) and plugins.tokenizer.tokenizer_type ({kind}) name two tokenizers; a run has "
                "one: drop the other"
            )
        return megatron_tokenizer(run.config.tokenizer.path, run.plugins.get("tokenizer"), needed_by)
    path, key = tokenizer_directory(run.config, own, own_key)
    return load_tokenizer(path, key, needed_by, run.config.tokenizer.trust_remote_code), Path(path)


def names_a_tokenizer(run: Run) -> bool:
    """Whether the run has a tokenizer: ``[tokenizer] path``, or one of Megatron's types."""
    return run.config.tokenizer.path is not None or megatron_type(run.plugins.get("tokenizer")) is not None


def handed_tokenizer(run: Run, needed_by: str) -> Any:
    """The run's tokenizer as the ``tokenizer`` plugin handed it to the data provider — the same
    object, so a pad token the provider gave it is there — or loaded when the plugin is off;
    None when the run names none."""
    if not names_a_tokenizer(run):
        return None
    handed = getattr(run.plugins.get("tokenizer"), "handed", None)
    return handed if handed is not None else run_tokenizer(run, None, "tokenizer.path", needed_by)[0]


def megatron_type(plugin: object | None) -> str | None:
    """The ``tokenizer`` plugin's ``tokenizer_type`` when it is one of Megatron's own (not a
    Hugging Face directory); None otherwise, or when the plugin is off."""
    kind = getattr(plugin, "tokenizer_type", None)
    return None if kind in (None, "HuggingFaceTokenizer") else str(kind)


_built: dict[str, Any] = {}
"""Tokenizers of Megatron's types built in this process, by their settings: built once however
many plugins ask (the providers, the tokenizer plugin's context)."""


def megatron_tokenizer(path: str | None, plugin: Any, needed_by: str) -> tuple[Any, Path]:
    """The tokenizer of one of Megatron's types: ``[tokenizer] path`` (its model file) and the
    ``tokenizer`` plugin's settings."""
    from coretrain_tokenizer import megatron

    settings = megatron.Settings(path=path, **{name: getattr(plugin, name) for name in megatron.Settings.PLUGIN_KEYS})
    key = repr(settings)
    if key not in _built:
        _built[key] = megatron.build(settings, needed_by)
    return _built[key], Path(path or plugin.vocab_file or ".")


@define(kw_only=True)
class Tokenizer:
    """``tokenizer`` (on by default): Megatron's tokenizer types for ``[tokenizer]``, and the
    run's tokenizer, loaded once, on every provider's ``DatasetContext``."""

    tokenizer_type: str | None = None
    """Megatron's: "HuggingFaceTokenizer" (as unset: a directory at ``[tokenizer] path``),
    "GPT2BPETokenizer" (``vocab_file``, ``merge_file``), "SentencePieceTokenizer" /
    "GPTSentencePieceTokenizer" / "Llama2Tokenizer" (a ``.model`` file at ``[tokenizer] path``,
    Megatron's ``tokenizer_model``), "TikTokenizer" (Megatron's JSON vocabulary at the path),
    "NullTokenizer" (``vocab_size``)."""
    vocab_file: str | None = None
    """GPT2BPETokenizer: GPT-2's vocab.json."""
    merge_file: str | None = None
    """GPT2BPETokenizer: GPT-2's merges.txt."""
    vocab_size: int | None = field(default=None, validator=positive)
    """NullTokenizer's ids; TikTokenizer's vocabulary with its special tokens (unset: 2**17)."""
    tiktoken_pattern: Literal["v1", "v2"] = "v2"
    """TikTokenizer: Megatron's pre-tokenization pattern."""
    tiktoken_num_special_tokens: int = field(default=1000, validator=positive)
    """TikTokenizer: the ids before the BPE's, for <unk>, <s>, </s>, ... and fillers."""

    handed: Any = field(default=None, init=False)
    """The tokenizer on the data provider's context, for the plugins that read its data after it."""

    @hookimpl(wrapper=True)
    def provide_datasets(self, run: Run, context: DatasetContext) -> Any:
        if names_a_tokenizer(run) and context.tokenizer is None:
            context.tokenizer, _ = run_tokenizer(run, None, "tokenizer.path", "the run's [tokenizer]")
        self.handed = context.tokenizer
        datasets = yield
        if isinstance(datasets, Datasets) and datasets.tokenizer is None:  # a provider that names no tokenizer
            datasets.tokenizer = context.tokenizer  # of its own reads the run's: it turns text into these ids
        return datasets


def chat_ids(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    """Token ids of ``messages`` rendered by the tokenizer's chat template (transformers 4 returns
    the ids, 5 an encoding holding them): for training on chats (``hf-sft``) and prompting with one."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
    return [int(i) for i in ids]


def padded_vocab(vocab_size: int, divisible_by: int | None, tp_size: int = 1) -> int:
    """Megatron's ``_vocab_size_with_padding``: up to a multiple of ``divisible_by`` × the
    tensor-parallel size (each rank then holds an equal slice of the embedding); None: as it is."""
    if not divisible_by:
        return vocab_size
    multiple = divisible_by * tp_size
    padded = -(-vocab_size // multiple) * multiple
    if padded != vocab_size:
        log.info("padded vocab (size: %d) with %d dummy tokens (new size: %d)", vocab_size, padded - vocab_size, padded)
    return padded
