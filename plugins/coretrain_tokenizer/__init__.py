"""The run's one tokenizer, ``[tokenizer]``, loaded alike by every plugin that needs one.

    [tokenizer]
    path = "models/tiny-llama"        # a local save_pretrained directory; nothing is downloaded
    trust_remote_code = false         # true: run the code a custom tokenizer (or model) ships

A library of coretrain-plugins (no entry point, like ``coretrain_windows``): ``hf-text``,
``hf-sft``, ``indexed``, ``predict`` and ``data prepare --config`` load their tokenizer here.
A provider's own ``tokenizer`` option, where it has one, still works; named beside
``[tokenizer]`` it must name the same directory (a run has one tokenizer). The model's
vocabulary is padded as Megatron pads it by the model providers' ``make_vocab_size_divisible_by``
(:func:`padded_vocab`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from coretrain import Run, UserError, require

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
    """The run's tokenizer (see :func:`tokenizer_directory`) and its directory."""
    path, key = tokenizer_directory(run.config, own, own_key)
    return load_tokenizer(path, key, needed_by, run.config.tokenizer.trust_remote_code), Path(path)


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
