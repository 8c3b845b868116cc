"""Fill-in-the-middle, as Megatron-LM's ``GPTFIMDataset`` makes it (``--fim-rate`` and the rest).

Each sample (``seq_length + 1`` token ids) is cut at the end-of-document token; each piece is,
with probability ``fim_rate``, detokenized, cut at two random character positions into prefix,
middle and suffix, retokenized and rearranged — PSM ``<pre> prefix <suf> suffix <mid> middle``,
or with probability ``fim_spm_rate`` SPM ``<pre> <suf> suffix <mid> prefix middle`` — and the
sample is cut or padded (``fim_pad``) back to its length. With ``fim_split_sample`` a piece is
first split at that token and each fragment rearranged with ``fim_fragment_rate``; a piece whose
text starts with ``fim_no_prefix`` is left alone. The random draws are Megatron's, in its order.

One difference, on purpose: Megatron draws from one generator per dataset in the order samples
are read (so a sample's form depends on which DataLoader worker read what before it); here each
sample has a generator of its own, seeded by (seed, sample index), so a resumed run and any number
of workers or ranks see the same samples.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from coretrain import UserError
from coretrain_indexed.samples import Windows


@attrs.frozen
class FIMTokens:
    """The ids of the sentinel tokens and of the end-of-document token."""

    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int
    split: int | None = None


@attrs.frozen
class FIM:
    """What the transformation needs: the rates, the tokenizer and its sentinel ids."""

    rate: float
    spm_rate: float
    tokenizer: Any
    tokens: FIMTokens
    fragment_rate: float | None = None
    no_prefix: str | None = None
    special: frozenset[str] = frozenset()
    """The tokenizer's special tokens, left out of a piece's text (Megatron's ``ids_to_text(...,
    remove_special_tokens=True)``)."""
    include_special_tokens: bool = True
    """Megatron's HuggingFaceTokenizer's (its default; ``--tokenizer-hf-no-include-special-tokens``
    turns it off): each part of a rearranged piece is encoded as ``tokenizer(text)`` encodes it,
    with the special tokens the tokenizer adds (a BOS before each part, with a tokenizer that
    starts every text with one). Off: the text's tokens alone."""

    def sample(self, sample: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """The sample with each document piece rearranged (or not), as long as it was."""
        eod, length = self.tokens.eod, len(sample)
        pieces: list[Any] = []
        start = 0
        for end in np.flatnonzero(sample == eod).tolist():
            if end > start:  # an empty piece, and the end-of-document token after it, are dropped (Megatron's)
                pieces += [self.split_and_permute(sample[start:end], rng), [eod]]
            start = end + 1
        pieces.append(self.split_and_permute(sample[start:], rng))
        out = np.concatenate(pieces).astype(np.int64)[:length]
        return np.concatenate([out, np.full(length - len(out), self.tokens.pad, dtype=np.int64)])

    def split_and_permute(self, piece: np.ndarray, rng: np.random.RandomState) -> np.ndarray:
        """With a split token: each fragment on its own (at ``fragment_rate``, when the piece is
        chosen at ``rate``); else the piece at ``rate``."""
        split = self.tokens.split
        breaks = np.flatnonzero(piece == split) if split is not None else np.empty(0, dtype=np.int64)
        if not len(breaks):
            return self.permute(piece, self.rate, rng)
        if not rng.binomial(1, self.rate):
            return piece
        fragments: list[Any] = []
        start = 0
        for end in breaks.tolist():
            if end > start:
                fragments += [self.permute(piece[start:end], self.fragment_rate or 0.0, rng), [split]]
            start = end + 1
        fragments.append(self.permute(piece[start:], self.fragment_rate or 0.0, rng))
        return np.concatenate(fragments).astype(np.int64)

    def permute(self, piece: np.ndarray, rate: float, rng: np.random.RandomState) -> np.ndarray:
        """One piece in PSM or SPM form, cut at two random characters of its text (or as it is)."""
        if not rng.binomial(1, rate):
            return piece
        text = self.decode(piece)
        if self.no_prefix is not None and text.startswith(self.no_prefix):
            return piece
        low, high = sorted(rng.randint(low=0, high=len(text) + 1, size=2))
        prefix, middle, suffix = (self.encode(part) for part in (text[:low], text[low:high], text[high:]))
        t = self.tokens
        if rng.binomial(1, self.spm_rate):
            return np.concatenate([[t.prefix, t.suffix], suffix, [t.middle], prefix, middle]).astype(np.int64)
        return np.concatenate([[t.prefix], prefix, [t.suffix], suffix, [t.middle], middle]).astype(np.int64)

    def decode(self, piece: np.ndarray) -> str:
        """The piece's text as Megatron's HuggingFaceTokenizer gives it (``ids_to_text`` with
        ``remove_special_tokens=True``, as its FIM asks since Megatron-LM 74ef64e, 2026-02): its
        tokens but the special ones, joined by the tokenizer (not ``decode``, which also cleans up
        spaces)."""
        tokens = self.tokenizer.convert_ids_to_tokens(piece.tolist())
        return str(
            self.tokenizer.convert_tokens_to_string([t for t in tokens if t is not None and t not in self.special])
        )

    def encode(self, text: str) -> np.ndarray:
        """Megatron's ``text_to_ids``: ``tokenizer(text)``'s ids with ``include_special_tokens``,
        else the text's tokens, then their ids."""
        if self.include_special_tokens:
            return np.array(self.tokenizer(text)["input_ids"], dtype=np.int64)
        return np.array(self.tokenizer.convert_tokens_to_ids(self.tokenizer.tokenize(text)), dtype=np.int64)


def sentinel_ids(tokenizer: Any, names: dict[str, str | None], eod: str | None) -> FIMTokens:
    """The sentinel tokens' ids in ``tokenizer`` (each must be one token of it: an added special
    token), the end-of-document id (``eod``'s, else the tokenizer's EOS)."""
    vocabulary = tokenizer.get_vocab()
    special = {*tokenizer.all_special_tokens, *tokenizer.get_added_vocab()}
    ids: dict[str, int | None] = {}
    for key, token in names.items():
        option = "fim_split_sample" if key == "split" else f"fim_{key}_token"
        if token is None:
            ids[key] = None
        elif token not in vocabulary:
            raise UserError(
                f"data.options.{option}: {token!r} is not a token of the tokenizer; add it as a "
                "special token (tokenizer.add_special_tokens) or name the one it has"
            )
        elif key != "split" and token not in special:
            raise UserError(
                f"data.options.{option}: {token!r} is an ordinary token of the tokenizer, not a special one: "
                "the data's own text would read as the sentinel; add a special token for it "
                "(tokenizer.add_special_tokens) or name one the tokenizer has"
            )
        else:
            ids[key] = int(vocabulary[token])
    sentinels = {key: ids[key] for key in ("prefix", "middle", "suffix", "pad")}
    if len(set(sentinels.values())) < len(sentinels):
        same = [f"fim_{key}_token" for key, value in sentinels.items() if list(sentinels.values()).count(value) > 1]
        raise UserError(
            f"data.options.{same[1]}: the same token as {same[0]} ({names[same[0][4:-6]]!r}); "
            "each FIM sentinel must be a token of its own"
        )
    if eod is not None and eod not in vocabulary:
        raise UserError(f"data.options.fim_eod_token: {eod!r} is not a token of the tokenizer")
    eod_id = vocabulary[eod] if eod is not None else tokenizer.eos_token_id
    if eod_id is None:
        raise UserError("data.options.fim_eod_token: the tokenizer has no EOS token; name the end-of-document token")
    if int(eod_id) in sentinels.values():
        raise UserError(
            f"data.options.fim_eod_token: the end-of-document token (id {eod_id}) is also a FIM sentinel; "
            "name another end-of-document token, or other sentinels"
        )
    return FIMTokens(
        prefix=_required(ids["prefix"]),
        middle=_required(ids["middle"]),
        suffix=_required(ids["suffix"]),
        pad=_required(ids["pad"]),
        eod=int(eod_id),
        split=ids.get("split"),
    )


def _required(value: int | None) -> int:
    assert value is not None  # the sentinel names have defaults; only split may be unset
    return value


class FIMWindows(Windows):
    """A dataset's windows with fill-in-the-middle applied, sample ``i`` from its own generator."""

    def __init__(self, base: Windows, fim: FIM, seed: int) -> None:
        self.base, self.fim, self.seed = base, fim, seed
        self.samples = base.samples

    def window(self, index: int) -> np.ndarray:
        rng = np.random.RandomState([self.seed % 2**32, index])
        return self.fim.sample(self.base.window(index), rng)
