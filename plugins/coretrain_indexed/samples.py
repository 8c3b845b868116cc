"""Samples over indexed documents as Megatron-Core's GPTDataset and BlendedDataset make them:
windows of ``seq_length + 1`` tokens that run across document boundaries of a seeded shuffled
document order, the train/valid/test split by documents, and blends by weight."""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from coretrain_windows import shifted

from coretrain import UserError
from coretrain_indexed.format import IndexedTokens

log = logging.getLogger("coretrain")


SPLIT_RULES = ("megatron-core", "megatron-lm-legacy")


def split_ranges(split: str, documents: int, rule: str = "megatron-core") -> list[tuple[int, int]]:
    """The train, valid and test document ranges for weights like ``"969,30,1"``.

    ``megatron-core``: as Megatron-Core's ``BlendedMegatronDatasetBuilder`` (the normalized
    weights' running sums are the bounds, each rounded: ``round(bound * n)``). ``megatron-lm-legacy``:
    as Megatron-LM's old ``get_train_valid_test_split_`` (each share rounded, the excess taken off
    every bound). The two differ for about a quarter of corpus sizes ("969,30,1": 4,860 of 1-20,000
    documents, first at 49: 47 or 48 train documents)."""
    weights = [float(part) for part in split.split(",")]
    weights += [0.0] * (3 - len(weights))
    if rule == "megatron-lm-legacy":
        total = sum(weights)
        bounds = [0]
        for weight in weights:
            bounds.append(bounds[-1] + int(round(weight / total * float(documents))))
        excess = bounds[-1] - documents
        bounds = [bounds[0]] + [bound - excess for bound in bounds[1:]]
    else:
        shares = np.array(weights, dtype=np.float64)
        edges = itertools.accumulate((shares / np.sum(shares)).tolist(), initial=0.0)  # Python floats, in order
        bounds = [int(round(edge * float(documents))) for edge in edges]
    return list(itertools.pairwise(bounds))


class Windows:
    """(input, target) samples and batches from ``window(i)``, seq_length + 1 token ids."""

    samples: int

    def __len__(self) -> int:
        return self.samples

    def window(self, index: int) -> np.ndarray:
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(self.window(index))
        return window[:-1], window[1:]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return shifted(torch.from_numpy(np.stack([self.window(int(i)) for i in indices])))


class DocumentWindows(Windows):
    """Megatron-Core's GPTDataset: sample i is sample ``shuffle[i]`` of the documents laid end to
    end in a seeded shuffled order, sample j being tokens ``[j·T, j·T + T + 1)`` of them,
    repeated for as many epochs as ``samples`` need (:func:`megatron_order`). The orders are
    cached in ``cache_dir`` (``.npy``, written atomically) and reused."""

    def __init__(
        self, source: IndexedTokens, documents: np.ndarray, seq_length: int, samples: int, seed: int, cache_dir: Path
    ) -> None:
        self.source, self.seq_length = source, seq_length
        lengths = source.document_lengths[documents]
        per_epoch = int(lengths.sum())
        if per_epoch < 2:
            raise ValueError("no tokens")
        epochs = max(math.ceil((samples * seq_length + 1) / per_epoch), 1)
        key: dict[str, Any] = {
            "prefix": os.path.abspath(source.prefix),
            "documents": [int(documents[0]), len(documents)],
        }
        key |= {"tokens": per_epoch, "seq_length": seq_length, "samples": samples, "seed": seed, "order": "megatron"}
        key["written"] = os.stat(f"{source.prefix}.idx").st_mtime_ns  # a re-prepared corpus is not the cached one
        self.samples = (epochs * per_epoch - 1) // seq_length
        build = functools.cache(lambda: megatron_order(documents, per_epoch, seq_length, samples, epochs, seed))
        self.order = cached(cache_dir, "order", key, lambda: build()[0], lambda o: order_problem(o, documents, epochs))
        self.shuffle = cached(cache_dir, "shuffle", key, lambda: build()[1], lambda o: shuffle_problem(o, self.samples))
        self.ends = np.cumsum(source.document_lengths[self.order], dtype=np.int64)

    def window(self, index: int) -> np.ndarray:
        if not 0 <= index < self.samples:
            raise IndexError(index)
        start, need = int(self.shuffle[index]) * self.seq_length, self.seq_length + 1
        position = int(np.searchsorted(self.ends, start, side="right"))
        offset = start - int(self.ends[position] - self.source.document_lengths[self.order[position]])
        parts = []
        while need > 0:
            tokens = self.source.document(int(self.order[position]))[offset : offset + need]
            parts.append(tokens)
            need, position, offset = need - len(tokens), position + 1, 0
        return np.concatenate(parts).astype(np.int64)


def megatron_order(
    documents: np.ndarray, per_epoch: int, seq_length: int, samples: int, epochs: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Megatron-Core's document index and shuffle index for ``samples`` samples over ``epochs``
    epochs of ``per_epoch`` tokens (its ``_build_document_sample_shuffle_indices``, with
    ``add_extra_token_to_sequence``): one ``RandomState(seed)`` shuffles the documents of all
    epochs — of all but the last, then the last's on its own, when the last epoch is needed for
    less than 80% of its samples (``separate_final_epoch``) — and then the samples, those of the
    last epoch again apart."""
    total = (epochs * per_epoch - 1) // seq_length
    before_last = ((epochs - 1) * per_epoch - 1) // seq_length
    separate = epochs > 1 and samples - before_last < int(0.80 * ((per_epoch - 1) // seq_length))
    state = np.random.RandomState(seed)

    def shuffled(values: np.ndarray) -> np.ndarray:
        state.shuffle(values)
        return values

    if separate:
        order = np.concatenate(
            [shuffled(np.tile(documents.astype(np.int32), epochs - 1)), shuffled(documents.astype(np.int32))]
        )
        shuffle = np.concatenate([shuffled(np.arange(before_last)), shuffled(np.arange(before_last, total))])
    else:
        order, shuffle = shuffled(np.tile(documents.astype(np.int32), epochs)), shuffled(np.arange(total))
    return order, shuffle.astype(np.int64)


class Blend(Windows):
    """Megatron's BlendedDataset: sample i comes from the dataset whose share so far lags its
    weight the most, so every prefix of the blend follows the weights."""

    def __init__(self, datasets: list[Windows], weights: list[float], samples: int, cache_dir: Path, key: Any) -> None:
        self.datasets = datasets
        total = sum(weights)
        normalized = [w / total for w in weights]
        self.index = cached(
            cache_dir,
            "blend",
            {"key": key, "samples": samples},
            lambda: blend_index(normalized, samples),
            lambda index: blend_problem(index, [len(d) for d in datasets], samples),
        )
        self.samples = samples

    def window(self, index: int) -> np.ndarray:
        dataset, sample = self.index[index]
        window: np.ndarray = self.datasets[int(dataset)].window(int(sample))
        return window


def blend_index(weights: list[float], samples: int) -> np.ndarray:
    """(dataset, its sample) for each blended sample: Megatron's build_blending_indices."""
    weight = np.asarray(weights)
    taken = np.zeros(len(weights), dtype=np.int64)
    index = np.empty((samples, 2), dtype=np.int64)
    for i in range(samples):
        chosen = int(np.argmax(weight * max(i, 1) - taken))
        index[i] = chosen, taken[chosen]
        taken[chosen] += 1
    return index


def blend_sizes(weights: list[float], samples: int) -> list[int]:
    """Samples to build from each dataset of a blend: Megatron's ``ceil(ceil(n·w)·1.005)``,
    ``w`` the normalized weight (its 0.5% margin)."""
    total = sum(weights)
    return [math.ceil(math.ceil(samples * (w / total)) * 1.005) for w in weights]


def order_problem(order: np.ndarray, documents: np.ndarray, epochs: int) -> str | None:
    """What makes ``order`` other than a shuffle of ``documents`` repeated ``epochs`` times."""
    if order.dtype != np.int32 or order.shape != (len(documents) * epochs,):
        return f"{order.dtype}[{', '.join(map(str, order.shape))}], not int32[{len(documents) * epochs}]"
    low, high = int(documents.min()), int(documents.max())
    if len(order) and (int(order.min()) < low or int(order.max()) > high):
        return f"document ids outside this split's {low}..{high}"
    counts = np.bincount(order.astype(np.int64) - low, minlength=high - low + 1)
    wanted = np.zeros(high - low + 1, dtype=np.int64)
    wanted[documents - low] = epochs
    return None if np.array_equal(counts, wanted) else f"not each of this split's documents {epochs} time(s)"


def shuffle_problem(shuffle: np.ndarray, samples: int) -> str | None:
    """What makes ``shuffle`` other than a permutation of the ``samples`` sample numbers."""
    if shuffle.dtype != np.int64 or shuffle.shape != (samples,):
        return f"{shuffle.dtype}[{', '.join(map(str, shuffle.shape))}], not int64[{samples}]"
    if not np.array_equal(np.bincount(shuffle, minlength=samples), np.ones(samples, dtype=np.int64)):
        return f"not each of the samples 0..{samples - 1} once"
    return None


def blend_problem(index: np.ndarray, sizes: list[int], samples: int) -> str | None:
    """What makes ``index`` other than a blend's (dataset, its sample) pairs, in order per dataset."""
    if index.dtype != np.int64 or index.shape != (samples, 2):
        return f"{index.dtype}[{', '.join(map(str, index.shape))}], not int64[{samples}, 2]"
    chosen = index[:, 0]
    if len(chosen) and (int(chosen.min()) < 0 or int(chosen.max()) >= len(sizes)):
        return f"dataset numbers outside 0..{len(sizes) - 1}"
    for number, size in enumerate(sizes):
        taken = index[chosen == number, 1]
        if len(taken) > size or not np.array_equal(taken, np.arange(len(taken))):
            return f"dataset {number}'s samples are not 0, 1, 2, ... below {size}"
    return None


def cached(directory: Path, kind: str, key: Any, build: Any, problem: Any) -> np.ndarray:
    """``build()``'s array, from ``directory`` when a run with the same ``key`` made it before —
    checked by ``problem(array)`` first (a cache copied from elsewhere, a damaged one, another
    split's: training on it would read other documents, silently)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = directory / f"{kind}-{digest}.npy"
    if path.is_file():
        try:
            found: np.ndarray = np.load(path, mmap_mode="r", allow_pickle=False)
            wrong = problem(found)
        except (OSError, ValueError) as exc:
            wrong = f"unreadable ({exc})"
        if wrong is not None:
            raise UserError(
                f"{path}: a cached sample order that does not fit this data ({wrong}); delete it and run "
                "again, and it is rebuilt"
            )
        return found
    array: np.ndarray = build()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        with open(temporary, "wb") as file:
            np.save(file, array)
        os.replace(temporary, path)  # ranks racing write the same bytes; the rename is atomic
    except OSError as exc:
        log.warning("indexed: cannot cache the sample index in %s (%s); it is rebuilt each run", directory, exc)
    return array
