"""The indexed provider's train/valid/test datasets, from data_path + split or one path per split."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from coretrain import DatasetContext, FieldValueError, UserError
from coretrain_indexed.fim import FIM, FIMWindows
from coretrain_indexed.format import IndexedTokens
from coretrain_indexed.samples import Blend, DocumentWindows, Windows, blend_sizes, split_ranges

SPLITS = ("train", "valid", "test")

BlendSpec = list[tuple[float, str]]


def parse_blend(value: Any, key: str) -> BlendSpec:
    """A prefix, a list of prefixes (equal weights) or ``[weight, prefix, weight, prefix, ...]``."""
    if isinstance(value, str):
        return [(1.0, value)]
    if isinstance(value, list) and value and all(isinstance(item, str) for item in value):
        return [(1.0, prefix) for prefix in value]
    pairs = list(zip(value[::2], value[1::2], strict=False)) if isinstance(value, list) else []
    if (
        pairs
        and len(value) % 2 == 0
        and all(
            isinstance(w, int | float) and not isinstance(w, bool) and 0 < w < math.inf and isinstance(p, str)
            for w, p in pairs
        )
        and math.isfinite(sum(w for w, _ in pairs))
    ):
        return [(float(w), p) for w, p in pairs]
    raise FieldValueError(
        key,
        f"expected a prefix ('data/corpus_text_document'), a list of prefixes, or a blend "
        f"[weight, prefix, weight, prefix, ...] with positive, finite weights; got {value!r}",
    )


@attrs.define
class Splits:
    train: Any
    valid: Any
    test: Any
    max_token: int


def build_splits(
    data_path: Any,
    split: tuple[str, str],
    paths: dict[str, Any],
    seq_length: int,
    context: DatasetContext,
    cache_dir: str | None,
    fim: FIM | None = None,
) -> Splits:
    """Each split's (blended) dataset sized by the context's sample counts; None where it has no
    documents. ``data_path`` split by ``split`` (the weights and the rounding rule), else ``paths``
    (split name -> prefix or blend)."""
    wanted = {"train": context.train_samples, "valid": context.valid_samples, "test": context.test_samples}
    if data_path is not None:
        blend = parse_blend(data_path, "data_path")
        sources = {prefix: IndexedTokens(prefix) for _, prefix in blend}
        weights, rule = split
        ranges = {prefix: split_ranges(weights, len(source), rule) for prefix, source in sources.items()}
        parts = {name: [(w, sources[p], np.arange(*ranges[p][i])) for w, p in blend] for i, name in enumerate(SPLITS)}
    else:
        parts = {}
        sources = {}
        for name in SPLITS:
            path = paths[name]
            blend = parse_blend(path, f"{name}_data_path") if path is not None else []
            sources |= {prefix: sources.get(prefix) or IndexedTokens(prefix) for _, prefix in blend}
            parts[name] = [(w, sources[p], np.arange(len(sources[p]))) for w, p in blend]
    cache = Path(cache_dir) if cache_dir else Path(next(iter(sources))).parent / "cache"
    built = {
        name: dataset(name, parts[name], seq_length, max(wanted[name], 1), context.seed, cache, fim) for name in SPLITS
    }
    if built["train"] is None:
        raise UserError("data.options: the train split has no documents; check data_path / split")
    return Splits(**built, max_token=max(max_token(source) for source in sources.values()))


def dataset(
    name: str,
    parts: list[tuple[float, IndexedTokens, np.ndarray]],
    seq_length: int,
    samples: int,
    seed: int,
    cache: Any,
    fim: FIM | None = None,
) -> Any:
    """One split: windows over each prefix's documents of it (fill-in-the-middle applied to each,
    as Megatron's GPTFIMDataset is one per prefix), blended by weight."""
    parts = [(w, source, documents) for w, source, documents in parts if len(documents)]
    if not parts:
        return None
    sizes = blend_sizes([w for w, _, _ in parts], samples) if len(parts) > 1 else [samples]
    try:
        windows = [
            DocumentWindows(source, documents, seq_length, size, seed, cache)  # one seed for all, as Megatron's
            for (_, source, documents), size in zip(parts, sizes, strict=True)
        ]
    except ValueError:
        raise UserError(f"data.options: the {name} split of {[s.prefix for _, s, _ in parts]} has no tokens") from None
    shown: list[Windows] = [FIMWindows(w, fim, seed) for w in windows] if fim is not None else list(windows)
    if len(shown) == 1:
        return shown[0]
    key = [name, seq_length, seed, [[w, s.prefix, len(d)] for w, s, d in parts]]
    return Blend(shown, [w for w, _, _ in parts], samples, cache, key)


def max_token(source: IndexedTokens, chunk: int = 1 << 24) -> int:
    """The largest token id in ``source`` (the vocabulary it needs); a negative id is an error."""
    tokens, largest = source.tokens, 0
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        if int(part.min()) < 0:
            raise UserError(
                f"{source.prefix}.bin: token id {int(part.min())} at or after token {start}; token ids are >= 0"
            )
        largest = max(largest, int(part.max()))
    return largest
