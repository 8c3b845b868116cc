"""``indexed``: Megatron's preprocessed ``.bin/.idx`` data (``preprocess_data.py`` or
``coretrain data prepare``), read without Megatron, with Megatron's ``data_path`` forms:

    [data]
    provider = "indexed"
    [data.options]
    data_path = [0.7, "data/web_text_document", 0.3, "data/code_text_document"]   # or one prefix
    split = "969,30,1"                  # documents of each prefix: train, valid, test
    split_rule = "megatron-core"        # rounded as Megatron-Core (or "megatron-lm-legacy")
    seq_length = 1024
    # or train_data_path / valid_data_path / test_data_path, each a prefix or a blend

The k-th sample of each split is Megatron-Core's ``GPTDataset`` / ``BlendedDataset`` ``[k]``
for the same files, ``split``, ``seq_length`` and seed (``run.seed`` = Megatron's
``random_seed``): windows of ``seq_length + 1`` tokens across document boundaries of its seeded
shuffled document order, taken in its shuffled sample order (the last, partial epoch shuffled
apart), blends drawing each sample from the prefix that lags its weight most, every prefix with
the one seed and ``ceil(ceil(n·w)·1.005)`` samples. The loop reads them in that order (no shuffle
of its own), so the k-th consumed sample is Megatron's ``train[k]``, across resumes and rank
counts. The orders are cached as ``.npy`` files in ``cache_dir`` (default: ``cache/`` beside
the first prefix) and reused.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import attrs
from attrs import define, field
from coretrain_tokenizer import run_tokenizer

from coretrain import DatasetContext, Datasets, FieldValueError, Run, UserError, hookimpl, in_range, positive
from coretrain_indexed.fim import FIM, sentinel_ids
from coretrain_indexed.splits import build_splits, parse_blend

NEEDED_BY = 'data.provider = "indexed"'


def _blend_or_unset(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        parse_blend(value, attribute.name)


def _split(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    try:
        weights = [float(part) for part in value.split(",")]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or not all(0 <= w < math.inf for w in weights) or not 0 < sum(weights) < math.inf:
        raise FieldValueError(
            attribute.name, f"expected up to 3 finite, non-negative weights like '969,30,1'; got {value!r}"
        )


@define(kw_only=True)
class Indexed:
    """Megatron's indexed .bin/.idx datasets: one prefix, a weighted blend, or a path per split."""

    data_path: Any = field(default=None, validator=_blend_or_unset)
    """A prefix, or a blend [weight, prefix, ...]; its documents are split by ``split``."""
    split: str = field(default="969,30,1", validator=_split)
    """Train, valid, test shares of each prefix's documents (with data_path)."""
    split_rule: Literal["megatron-core", "megatron-lm-legacy"] = "megatron-core"
    """How the shares are rounded to documents: as Megatron-Core's dataset builder (each running
    bound rounded), or as Megatron-LM's legacy ``get_train_valid_test_split_`` (each share rounded,
    the excess taken off): they differ for about a quarter of corpus sizes."""
    train_data_path: Any = field(default=None, validator=_blend_or_unset)
    """Instead of data_path: the training prefix or blend (all of its documents)."""
    valid_data_path: Any = field(default=None, validator=_blend_or_unset)
    """With train_data_path: the validation prefix or blend."""
    test_data_path: Any = field(default=None, validator=_blend_or_unset)
    """With train_data_path: the test prefix or blend."""
    seq_length: int = field(default=1024, validator=positive)
    """Tokens per sample (each sample reads one more, for the shifted target)."""
    vocab_size: int | None = field(default=None, validator=positive)
    """Passed on to the model; unset = the run's tokenizer's (``[tokenizer] path``: its length,
    what Megatron's tokenizer gives), else the largest token id in the data + 1."""
    cache_dir: str | None = None
    """Where the sample orders are cached; unset = ``cache/`` beside the first prefix."""
    fim_rate: float = field(default=0.0, validator=in_range(0, 1))
    """Fill-in-the-middle (Megatron-LM's ``--fim-rate``): the share of document pieces rearranged
    into prefix/suffix/middle form; needs the run's ``[tokenizer] path``. 0: off."""
    fim_spm_rate: float = field(default=0.5, validator=in_range(0, 1))
    """The share of rearranged pieces in SPM form (suffix first); the rest are PSM."""
    fim_split_sample: str | None = None
    """A token (a file separator) at which a piece is split, each fragment rearranged on its own."""
    fim_fragment_rate: float | None = field(default=None, validator=in_range(0, 1))
    """The share of fragments rearranged when fim_split_sample splits a piece."""
    fim_no_prefix: str | None = None
    """A piece whose text starts with this is left as it is."""
    fim_prefix_token: str = "<fim_prefix>"
    """Fill-in-the-middle's prefix sentinel."""
    fim_middle_token: str = "<fim_middle>"
    """Fill-in-the-middle's middle sentinel."""
    fim_suffix_token: str = "<fim_suffix>"
    """Fill-in-the-middle's suffix sentinel."""
    fim_pad_token: str = "<fim_pad>"
    """The sentinel tokens (each one token of the tokenizer: its added special tokens)."""
    fim_eod_token: str | None = None
    """The end-of-document token pieces are cut at; unset = the tokenizer's EOS."""
    include_special_tokens: bool = True
    """As Megatron's HuggingFaceTokenizer (its default; ``--tokenizer-hf-no-include-special-tokens``
    is false here): fill-in-the-middle encodes each part of a piece with the special tokens the
    tokenizer adds (a BOS), as Megatron-LM does. ``coretrain data prepare --config`` reads it too
    (each document with the tokenizer's BOS, or without), so data and FIM agree."""

    def __attrs_post_init__(self) -> None:
        if self.fim_split_sample is not None and self.fim_fragment_rate is None:
            raise FieldValueError("fim_fragment_rate", "fim_split_sample splits pieces: set the fragments' rate too")

    @hookimpl
    def provide_datasets(self, run: Run, context: DatasetContext) -> Datasets:
        if (self.data_path is None) == (self.train_data_path is None):
            raise UserError(
                "data.options: set data_path (split by data.options.split) or train_data_path "
                "(with valid_data_path / test_data_path), not both or neither"
            )
        paths = {name: getattr(self, f"{name}_data_path") for name in ("train", "valid", "test")}
        fim = self.fill_in_the_middle(run) if self.fim_rate > 0 else None
        split = (self.split, self.split_rule)
        splits = build_splits(self.data_path, split, paths, self.seq_length, context, self.cache_dir, fim)
        vocab_size, key = self.vocab_size, "data.options.vocab_size"
        if vocab_size is None and run.config.tokenizer.path is not None:
            tokenizer, _ = run_tokenizer(run, None, key, NEEDED_BY)
            vocab_size, key = len(tokenizer), "tokenizer.path"
        if vocab_size is not None and splits.max_token >= vocab_size:
            raise UserError(
                f"{key}: the vocabulary has {vocab_size} tokens, but the data holds token id {splits.max_token}; "
                f"set data.options.vocab_size to at least {splits.max_token + 1}, or check the tokenizer"
            )
        return Datasets(
            train=splits.train,
            valid=splits.valid,
            test=splits.test,
            seq_length=self.seq_length,
            vocab_size=vocab_size or splits.max_token + 1,
            in_order=True,  # shuffled as Megatron shuffles them: the loop reads sample k at consumed sample k
        )

    def fill_in_the_middle(self, run: Run) -> FIM:
        """The FIM transformation with the run's tokenizer and its sentinel tokens."""
        tokenizer, _ = run_tokenizer(run, None, "data.options.fim_rate", NEEDED_BY)
        names: dict[str, str | None] = {"prefix": self.fim_prefix_token, "middle": self.fim_middle_token}
        names |= {"suffix": self.fim_suffix_token}
        names |= {"pad": self.fim_pad_token, "split": self.fim_split_sample}
        tokens = sentinel_ids(tokenizer, names, self.fim_eod_token)
        special = frozenset(tokenizer.all_special_tokens)
        return FIM(
            *(self.fim_rate, self.fim_spm_rate, tokenizer, tokens, self.fim_fragment_rate, self.fim_no_prefix),
            special=special,
            include_special_tokens=self.include_special_tokens,
        )
