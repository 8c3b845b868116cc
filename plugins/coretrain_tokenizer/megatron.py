"""Megatron's tokenizer types, as transformers tokenizers: every provider that takes a Hugging
Face tokenizer (``hf-text``, ``hf-sft``, ``indexed``, ``predict``, ``data prepare``) takes them.

- ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``vocab_file`` (vocab.json) and
  ``merge_file`` (merges.txt), its end of document ``<|endoftext|>``;
- ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer`` / ``Llama2Tokenizer``: a
  SentencePiece ``.model`` file (``path``), ids as ``encode_as_ids`` gives them, no BOS added
  (Megatron-Core's sentencepiece library, extra whitespace ignored);
- ``TikTokenizer``: Megatron's tiktoken vocabulary (a JSON list of ``rank`` / ``token_bytes`` /
  ``token_str``, ``path``), its ``tiktoken_num_special_tokens`` first ids for ``<unk>``, ``<s>``,
  ``</s>``, ... and fillers, the BPE ids after them, split by ``tiktoken_pattern`` v1 or v2;
- ``NullTokenizer``: text of whitespace-separated ids, ``vocab_size`` of them, the last the end
  of document (Megatron's benchmarking tokenizer).

Each is checked against Megatron-Core's own classes by ``benchmarks/megatron_tokenizer_parity.py``.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from attrs import frozen

from coretrain import UserError, require

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"]
"""Megatron's TikTokenizer's first ids, in order; fillers ``<SPECIAL_i>`` up to the count."""
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
}
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
TYPES = ("HuggingFaceTokenizer", "GPT2BPETokenizer", *SENTENCEPIECE_TYPES, "TikTokenizer", "NullTokenizer")


@frozen(kw_only=True)
class Settings:
    """What builds one of Megatron's types: ``[tokenizer] path`` and the ``tokenizer`` plugin's keys."""

    PLUGIN_KEYS = (
        "tokenizer_type",
        "vocab_file",
        "merge_file",
        "vocab_size",
        "tiktoken_pattern",
        "tiktoken_num_special_tokens",
    )

    tokenizer_type: str
    path: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    tiktoken_pattern: str = "v2"
    tiktoken_num_special_tokens: int = 1000


def build(config: Settings, needed_by: str) -> Any:
    """The tokenizer of one of Megatron's types (``tokenizer_type`` other than Hugging Face's)."""
    kind = config.tokenizer_type
    if kind == "GPT2BPETokenizer":
        return gpt2_bpe(
            _file(config.vocab_file, "plugins.tokenizer.vocab_file", kind),
            _file(config.merge_file, "plugins.tokenizer.merge_file", kind),
        )
    if kind in SENTENCEPIECE_TYPES:
        return _sentencepiece_class(needed_by)(_file(config.path, "tokenizer.path", kind))
    if kind == "TikTokenizer":
        size = config.vocab_size or 2**17
        return _tiktoken_class(needed_by)(
            _file(config.path, "tokenizer.path", kind),
            config.tiktoken_pattern,
            config.tiktoken_num_special_tokens,
            size,
        )
    if kind == "NullTokenizer":
        if not config.vocab_size:
            raise UserError('plugins.tokenizer.vocab_size: tokenizer_type = "NullTokenizer" needs the vocabulary size')
        return _null_class(needed_by)(config.vocab_size)
    raise UserError(f"plugins.tokenizer.tokenizer_type: {kind!r} is not one of {', '.join(TYPES)}")


def _file(path: str | None, key: str, kind: str) -> str:
    if not path:
        raise UserError(f"{key}: tokenizer_type = {kind!r} reads its vocabulary from this file; set it")
    if not Path(path).is_file():
        raise UserError(f"{key}: {path} is not a file ({kind} reads its vocabulary from it)")
    return path


def gpt2_bpe(vocab_file: str, merge_file: str) -> Any:
    """GPT-2's byte-level BPE, built with the tokenizers library (the same in every transformers)."""
    tokenizers = require("tokenizers", needed_by="tokenizer_type GPT2BPETokenizer", extra="hf")
    transformers = require("transformers", needed_by="tokenizer_type GPT2BPETokenizer", extra="hf")
    model = tokenizers.models.BPE.from_file(vocab_file, merge_file)
    inner = tokenizers.Tokenizer(model)
    inner.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = tokenizers.decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|endoftext|>")


def _sentencepiece_class(needed_by: str) -> Any:
    spm = require("sentencepiece", needed_by=needed_by, extra="megatron-tokenizers")
    base = require("transformers", needed_by=needed_by, extra="hf").PreTrainedTokenizer

    class SentencePieceTokenizer(base):  # type: ignore[misc,valid-type]
        """A SentencePiece model as a transformers tokenizer: its pieces and ids, unchanged."""

        def __init__(self, model_file: str, **kwargs: Any) -> None:
            self.model = spm.SentencePieceProcessor(model_file=model_file)
            specials = {
                "unk_token": self.model.unk_id(),
                "bos_token": self.model.bos_id(),
                "eos_token": self.model.eos_id(),
            }
            named = {key: self.model.id_to_piece(i) for key, i in specials.items() if i >= 0}
            super().__init__(**named, **kwargs)

        @property
        def vocab_size(self) -> int:
            return int(self.model.get_piece_size())

        def get_vocab(self) -> dict[str, int]:
            return {self.model.id_to_piece(i): i for i in range(self.vocab_size)}

        def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
            return list(self.model.encode_as_pieces(text))

        def _convert_token_to_id(self, token: str) -> int:
            return int(self.model.piece_to_id(token))

        def _convert_id_to_token(self, index: int) -> str:
            return str(self.model.id_to_piece(index))

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return str(self.model.decode_pieces(tokens))

    return SentencePieceTokenizer


def _tiktoken_class(needed_by: str) -> Any:
    tiktoken = require("tiktoken", needed_by=needed_by, extra="megatron-tokenizers")
    base = require("transformers", needed_by=needed_by, extra="hf").PreTrainedTokenizer

    class TikTokenizer(base):  # type: ignore[misc,valid-type]
        """Megatron's TikTokenizer as a transformers tokenizer; tokens are ids as text in between."""

        def __init__(self, path: str, pattern: str, specials: int, vocab_size: int, **kwargs: Any) -> None:
            if pattern not in TIKTOKEN_PATTERNS:
                raise UserError(f"plugins.tokenizer.tiktoken_pattern: {pattern!r} is not v1 or v2 (Megatron's two)")
            names = SPECIAL_TOKENS + [f"<SPECIAL_{i}>" for i in range(len(SPECIAL_TOKENS), specials)]
            self.specials, self.size = names, vocab_size
            ranks = {
                base64.b64decode(entry["token_bytes"]): entry["rank"] + specials
                for entry in json.loads(Path(path).read_text())[: vocab_size - specials]
            }
            self.encoding = tiktoken.Encoding(
                name=Path(path).stem,
                pat_str=TIKTOKEN_PATTERNS[pattern],
                mergeable_ranks=ranks,
                special_tokens={name: i for i, name in enumerate(names)},
            )
            super().__init__(unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>", **kwargs)

        @property
        def vocab_size(self) -> int:
            return self.size

        def get_vocab(self) -> dict[str, int]:
            return {self._convert_id_to_token(i): i for i in range(self.encoding.n_vocab)}

        def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
            return [str(i) for i in self.encoding.encode(text, allowed_special="all")]

        def _convert_token_to_id(self, token: str) -> int:
            return self.specials.index(token) if token in self.specials else int(token)

        def _convert_id_to_token(self, index: int) -> str:
            return self.specials[index] if index < len(self.specials) else str(index)

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return str(self.encoding.decode([self._convert_token_to_id(token) for token in tokens]))

    return TikTokenizer


def _null_class(needed_by: str) -> Any:
    base = require("transformers", needed_by=needed_by, extra="hf").PreTrainedTokenizer

    class NullTokenizer(base):  # type: ignore[misc,valid-type]
        """Text of whitespace-separated ids (Megatron's NullTokenizer); the last id ends a document."""

        def __init__(self, vocab_size: int, **kwargs: Any) -> None:
            self.size = vocab_size
            super().__init__(eos_token=str(vocab_size - 1), **kwargs)

        @property
        def vocab_size(self) -> int:
            return self.size

        def get_vocab(self) -> dict[str, int]:
            return {str(i): i for i in range(self.size)}

        def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
            return text.split()

        def _convert_token_to_id(self, token: str) -> int:
            return int(token)

        def _convert_id_to_token(self, index: int) -> str:
            return str(index)

        def convert_tokens_to_string(self, tokens: list[str]) -> str:
            return " ".join(tokens)

    return NullTokenizer
