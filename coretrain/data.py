"""Deterministic, resumable micro-batches for one data-parallel rank.

The sample order is a seeded permutation per epoch, so the position in the stream is a single
number (consumed samples) and resuming needs nothing else. Each global batch is a contiguous
run of that order; rank r takes the r-th equal block of it and cuts it into micro-batches, so
changing the number of ranks or micro-batches never changes which samples make a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import default_collate


class SampleOrder:
    """Position -> dataset index, shuffled per epoch with a seed of its own."""

    def __init__(self, length: int, seed: int) -> None:
        if length <= 0:
            raise ValueError("dataset is empty")
        self.length, self.seed = length, seed
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.length, generator=generator)
        return self._perm

    def indices(self, start: int, count: int) -> torch.Tensor:
        epoch, offset = divmod(start, self.length)
        if epoch == self._epoch and offset + count <= self.length:  # the common case, kept cheap
            return self._perm[offset : offset + count]
        parts = []
        while count > 0:
            epoch, offset = divmod(start, self.length)
            take = min(count, self.length - offset)
            parts.append(self._permutation(epoch)[offset : offset + take])
            start, count = start + take, count - take
        return parts[0] if len(parts) == 1 else torch.cat(parts)


def fetch(dataset: Any, indices: torch.Tensor, collate: Callable[[list[Any]], Any] | None = None) -> Any:
    """One collated batch: the dataset's ``get_batch`` fast path, else per-sample + collate
    (the given ``collate``, else torch's default_collate)."""
    get_batch = getattr(dataset, "get_batch", None)
    if get_batch is not None:
        return get_batch(indices)
    return (collate or default_collate)([dataset[i] for i in indices.tolist()])


def batch_size(batch: Any) -> int:
    """Samples in a collated batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else []
    return next((batch_size(item) for item in items if isinstance(item, (torch.Tensor, dict, list, tuple))), 1)


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class BatchReader:
    """The micro-batches one rank computes for each global batch (bound once, read every step).

    A global batch starting at position ``start`` is order[start : start + global]; rank r
    takes the r-th equal block and cuts it into micro-batches.
    """

    def __init__(
        self,
        dataset: Any,
        order: SampleOrder,
        rank: int,
        world_size: int,
        device: torch.device,
        collate: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.dataset, self.order, self.rank, self.world_size = dataset, order, rank, world_size
        self.device = device if device.type != "cpu" else None
        get_batch = getattr(dataset, "get_batch", None)
        self.get_batch = get_batch if get_batch is not None else (lambda indices: fetch(dataset, indices, collate))

    def read(self, start: int, global_batch_size: int, micro_batch_size: int) -> list[Any]:
        per_rank = global_batch_size // self.world_size
        indices = self.order.indices(start + self.rank * per_rank, per_rank)
        if per_rank == micro_batch_size:
            batches = [self.get_batch(indices)]
        else:
            batches = [self.get_batch(indices[i : i + micro_batch_size]) for i in range(0, per_rank, micro_batch_size)]
        if self.device is not None:
            batches = [to_device(b, self.device) for b in batches]
        return batches


class TokenWindows:
    """Non-overlapping (input, target) windows of ``seq_length`` over a 1-D token tensor.

    Sample i is tokens[i·T : i·T + T + 1] split into input and next-token target, as nanoGPT
    and Megatron's GPT datasets do. Works on memory-mapped tensors: only the windows a batch
    needs are read. ``get_batch`` gathers a whole micro-batch with one indexing op.
    """

    def __init__(self, tokens: torch.Tensor, seq_length: int) -> None:
        if tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor")
        self.tokens, self.seq_length = tokens, seq_length
        self._offsets = torch.arange(seq_length + 1)

    def __len__(self) -> int:
        return max((self.tokens.numel() - 1) // self.seq_length, 0)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_length
        window = self.tokens[start : start + self.seq_length + 1].long()
        return window[:-1], window[1:]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.tokens[(indices * self.seq_length).unsqueeze(1) + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]


def _mix(values: torch.Tensor) -> torch.Tensor:
    """A stateless 64-bit integer hash (splitmix64's finalizer; int64 arithmetic wraps)."""
    x = values * -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


class RandomWindows:
    """``count`` (input, target) windows at random offsets, as nanoGPT samples its batches.

    Window i starts at a seeded hash of i, so the windows are fixed by (seed, index): the
    sample order and resume treat them like any map-style dataset, and a run built for
    ``count`` = the samples it will consume sees a fresh random offset for every sample.
    """

    def __init__(self, tokens: torch.Tensor, seq_length: int, count: int, seed: int) -> None:
        if tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor")
        self.tokens, self.seq_length, self.count = tokens, seq_length, count
        self.span = tokens.numel() - seq_length  # offsets 0 .. span-1 leave room for the target
        self.salt = (seed + 1) * 1_000_003
        self._offsets = torch.arange(seq_length + 1)

    def __len__(self) -> int:
        return self.count if self.span > 0 else 0

    def starts(self, indices: torch.Tensor) -> torch.Tensor:
        return torch.remainder(_mix(indices.long() + self.salt), self.span)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = int(self.starts(torch.tensor([index]))[0])
        window = self.tokens[start : start + self.seq_length + 1].long()
        return window[:-1], window[1:]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.tokens[self.starts(indices).unsqueeze(1) + self._offsets].long()
        return windows[:, :-1], windows[:, 1:]


def windows(tokens: torch.Tensor, seq_length: int, sampling: str, count: int, seed: int) -> Any:
    """Fixed, non-overlapping windows, or ``count`` windows at random offsets ("random")."""
    if sampling == "random":
        return RandomWindows(tokens, seq_length, max(count, (tokens.numel() - 1) // seq_length), seed)
    return TokenWindows(tokens, seq_length)
