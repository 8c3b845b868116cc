"""This rank's micro-batches, step by step: in the loop, or prepared by DataLoader workers.

The sample order (:class:`coretrain.data.SampleOrder`) decides which samples make each global
batch, from the number of samples consumed so far; rank r takes the r-th equal block. That
stays the one source of truth whichever way batches are read, so resume is exact and does
not depend on the number of ranks or workers:

- ``data.num_workers = 0``: :class:`coretrain.data.BatchReader` reads them in the loop — the
  in-memory fast path (a ``get_batch(indices)`` dataset costs one indexing op per step);
- ``data.num_workers > 0``: a ``torch.utils.data.DataLoader`` whose batch sampler walks the
  same order (:class:`RankBatchSampler`), so workers read, collate and pin batches ahead
  while the GPU trains.

How many micro-batches a step takes is decided once per step, in order (:class:`StepPlan`),
because the sampler runs ahead of the loop (batch-size rampup changes it on the way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from coretrain.data import BatchReader, SampleOrder, fetch, to_device


class StepPlan:
    """Micro-batches per rank for each step, decided once, in step order, whoever asks first."""

    def __init__(self, decide: Callable[[int, int], int], micro_batch_size: int, world_size: int,
                 last_step: int, consumed_samples: int) -> None:
        self._decide, self._per_micro = decide, micro_batch_size * world_size
        self._next_step, self._next_consumed = last_step + 1, consumed_samples
        self._decided: dict[int, tuple[int, int]] = {}

    def at(self, step: int) -> tuple[int, int]:
        """(micro-batches per rank, samples consumed before it) for ``step``."""
        while self._next_step <= step:
            n_micro = self._decide(self._next_step, self._next_consumed)
            self._decided[self._next_step] = (n_micro, self._next_consumed)
            self._next_consumed += n_micro * self._per_micro
            self._next_step += 1
        return self._decided[step]

    def forget_before(self, step: int) -> None:
        for old in [s for s in self._decided if s < step]:
            del self._decided[old]


class RankBatchSampler:
    """Index lists of this rank's micro-batches, step after step, from ``first_step`` on.

    Lists, not tensors: they go to the workers through a queue, where a tensor would cost a
    shared-memory handoff per micro-batch."""

    def __init__(self, order: SampleOrder, plan: StepPlan, rank: int, world_size: int, micro_batch_size: int,
                 first_step: int) -> None:
        self.order, self.plan, self.rank, self.world = order, plan, rank, world_size
        self.micro, self.first_step = micro_batch_size, first_step

    def __iter__(self) -> Iterator[list[int]]:
        step = self.first_step
        while True:
            n_micro, consumed = self.plan.at(step)
            per_rank = self.micro * n_micro
            indices = self.order.indices(consumed + self.rank * per_rank, per_rank)
            for i in range(n_micro):
                yield indices[i * self.micro:(i + 1) * self.micro].tolist()
            step += 1


class MicroBatches(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A dataset whose item for a list of indices is their collated micro-batch (for workers)."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any] | None) -> None:
        self.dataset, self.collate = dataset, collate

    def __getitem__(self, indices: list[int]) -> Any:
        return fetch(self.dataset, torch.as_tensor(indices, dtype=torch.long), self.collate)


def data_loader(dataset: Any, sampler: Any, run: Any) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    cfg = run.config.data
    return torch.utils.data.DataLoader(
        MicroBatches(dataset, run.datasets.collate_fn), batch_size=None, sampler=sampler,
        num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor,
        pin_memory=cfg.pin_memory and run.device.type == "cuda", persistent_workers=False,
        worker_init_fn=_one_thread)


def _one_thread(worker_id: int) -> None:
    torch.set_num_threads(1)  # workers prepare data; the training process owns the cores


class TrainBatches:
    """The training loop's source of micro-batches (on the run's device), one step at a time."""

    def __init__(self, run: Any, plan: StepPlan, first_step: int) -> None:
        self.run, self.plan = run, plan
        dataset = run.datasets.train
        order = SampleOrder(len(dataset), run.config.run.seed)
        self.device = run.device if run.device.type != "cpu" else None
        micro = run.config.train.micro_batch_size
        if run.config.data.num_workers == 0:
            self._reader: BatchReader | None = BatchReader(dataset, order, run.dist.rank, run.dist.world_size,
                                                            run.device, run.datasets.collate_fn)
            self._iterator: Iterator[Any] | None = None
        else:
            self._reader = None
            sampler = RankBatchSampler(order, plan, run.dist.rank, run.dist.world_size, micro, first_step)
            self._iterator = iter(data_loader(dataset, sampler, run))

    def step(self, step: int) -> list[Any]:
        n_micro, consumed = self.plan.at(step)
        self.plan.forget_before(step)
        if self._reader is not None:
            micro = self.run.config.train.micro_batch_size
            return self._reader.read(consumed, micro * n_micro * self.run.dist.world_size, micro)
        assert self._iterator is not None
        batches = [next(self._iterator) for _ in range(n_micro)]
        return [to_device(b, self.device) for b in batches] if self.device is not None else batches
