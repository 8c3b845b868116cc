"""Deterministic, resumable micro-batches for one data-parallel rank.

The sample order is a seeded permutation per epoch, so the position in the stream is a single
number (consumed samples) and resuming needs nothing else. Each global batch is a contiguous
run of that order; rank r takes the r-th equal block of it and cuts it into micro-batches, so
changing the number of ranks or micro-batches never changes which samples make a step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import default_collate


class SampleOrder:
    """Position -> dataset index, shuffled per epoch with a seed of its own (or in the dataset's
    order, ``shuffle=False``, for a dataset whose order is its training order already)."""

    def __init__(self, length: int, seed: int, shuffle: bool = True) -> None:
        if length <= 0:
            raise ValueError("dataset is empty")
        self.length, self.seed, self.shuffle = length, seed, shuffle
        self._epoch, self._perm = -1, torch.arange(length)

    def _permutation(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order, shuffled from (seed + epoch) alone: the same on every rank and
        after any resume; the last one drawn is kept, as the loop reads one epoch after another."""
        if epoch != self._epoch and self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.length, generator=generator)
        return self._perm

    def indices(self, start: int, count: int) -> torch.Tensor:
        """Positions ``start`` to ``start + count`` of the endless order (epochs back to back), as
        sample indices; a batch that crosses an epoch's end takes the next epoch's first samples."""
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
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else []
    return next((batch_size(item) for item in items if isinstance(item, (torch.Tensor, Mapping, list, tuple))), 1)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch``'s tensors on ``device`` (non-blocking: pinned memory overlaps the copy), nested in
    the same lists, tuples, namedtuples and dicts; anything else as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(b, device) for b in batch]  # a namedtuple takes them by position, not as one list
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return {k: to_device(v, device) for k, v in batch.items()} if isinstance(batch, Mapping) else batch


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
        self.get_batch = getattr(dataset, "get_batch", None) or (lambda indices: fetch(dataset, indices, collate))

    def read(self, start: int, global_batch_size: int, micro_batch_size: int) -> list[Any]:
        """This rank's micro-batches of the global batch at position ``start`` of the order."""
        per_rank = global_batch_size // self.world_size
        indices = self.order.indices(start + self.rank * per_rank, per_rank)
        if per_rank == micro_batch_size:  # the common case: no slicing
            batches = [self.get_batch(indices)]
        else:
            batches = [self.get_batch(indices[i : i + micro_batch_size]) for i in range(0, per_rank, micro_batch_size)]
        return batches if self.device is None else [to_device(b, self.device) for b in batches]
