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

A stream (an ``IterableDataset``, or anything iterable without ``__getitem__``) has no
sample order to walk: a plugin reads it (hook ``read_stream``; coretrain-plugins' ``streams``
deals its items out to ranks and workers and checkpoints the position with torchdata's
``StatefulDataLoader``), and its loader's ``state_dict()`` goes into the checkpoint.

Random numbers: no loader draws from the run's global generator (a DataLoader takes its
workers' base seed from it each time an iterator is made, so a resumed run, which makes one
more, would train on other dropout masks): each gets a generator of its own, seeded from the
run's seed and the rank (:func:`loader_generator`). A worker seeds its random streams before
each micro-batch of a map-style split from (run seed, the batch's position in the sample
order) (:func:`seed_worker`), so a dataset's random augmentations are the same however many
workers read them and wherever a run resumed. A stream that draws random numbers keeps its
generator in its own ``state_dict()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coretrain.run import Run

import functools
import random
import signal
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from coretrain.data import BatchReader, SampleOrder, batch_size, fetch, to_device
from coretrain.errors import UserError
from coretrain.pluginmanager import hook_calls


def is_stream(dataset: Any) -> bool:
    """An iterable dataset: read in order, not by index."""
    return isinstance(dataset, torch.utils.data.IterableDataset) or (
        hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")
    )


def read_stream(run: Run, dataset: Any, micro_batch_size: int, training: bool) -> Any:
    """A plugin's loader of this rank's micro-batches of a stream (hook ``read_stream``)."""
    calls = hook_calls(run)
    if calls.implemented("read_stream"):
        reader = calls.hook.read_stream(run=run, dataset=dataset, micro_batch_size=micro_batch_size, training=training)
        if reader is not None:
            return reader
    raise UserError(
        "a split is a stream (an IterableDataset) and no plugin reads streams: coretrain-plugins' "
        "`streams` does (on by default; is it disabled or not installed?)"
    )


def loader_settings(run: Run) -> dict[str, Any]:
    """The ``torch.utils.data.DataLoader`` arguments every loader of a run shares: ``data.*``'s
    workers, pinning and prefetch; workers that leave the run's exit signals to the main process
    (:func:`worker_init_fn`); a generator of its own, fixed by (run seed, rank)."""
    cfg = run.config.data
    settings: dict[str, Any] = dict(
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and run.device.type == "cuda",
        worker_init_fn=worker_init_fn(run),
        generator=loader_generator(run),
    )
    if cfg.num_workers:
        settings["prefetch_factor"] = cfg.prefetch_factor
    return settings


class StepPlan:
    """Micro-batches per rank for each step, decided once, in step order, whoever asks first."""

    def __init__(
        self, decide: Callable[[int, int], int], samples_per_micro_batch: int, last_step: int, consumed_samples: int
    ) -> None:
        self._decide, self._per_micro = decide, samples_per_micro_batch
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

    def forget(self, step: int) -> None:
        """The loop is past ``step`` (and so is the sampler, which produced its batches)."""
        self._decided.pop(step, None)


class RankBatchSampler:
    """This rank's micro-batches, step after step, from ``first_step`` on: each as (its first
    sample's position in the order, the index list) — the position seeds the worker that reads it.

    Lists, not tensors: they go to the workers through a queue, where a tensor would cost a
    shared-memory handoff per micro-batch."""

    def __init__(
        self, order: SampleOrder, plan: StepPlan, rank: int, world_size: int, micro_batch_size: int, first_step: int
    ) -> None:
        self.order, self.plan, self.rank, self.world = order, plan, rank, world_size
        self.micro, self.first_step = micro_batch_size, first_step

    def __iter__(self) -> Iterator[tuple[int, list[int]]]:
        """Endless: the loop stops asking; the steps' micro-batch counts come from the plan."""
        step = self.first_step
        while True:
            n_micro, consumed = self.plan.at(step)
            per_rank = self.micro * n_micro
            start = consumed + self.rank * per_rank
            indices = self.order.indices(start, per_rank)
            for i in range(n_micro):
                yield start + i * self.micro, indices[i * self.micro : (i + 1) * self.micro].tolist()
            step += 1


class MicroBatches(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A dataset whose item for (position, indices) is their collated micro-batch, read by a
    worker whose random streams are first seeded from (``seed``, position)."""

    def __init__(self, dataset: Any, collate: Callable[[list[Any]], Any] | None, seed: int) -> None:
        self.dataset, self.collate, self.seed = dataset, collate, seed

    def __getitem__(self, item: tuple[int, list[int]]) -> Any:
        """The micro-batch at ``position`` of the order, its random draws seeded by that position."""
        position, indices = item
        seed_worker(self.seed, position)
        return fetch(self.dataset, torch.as_tensor(indices, dtype=torch.long), self.collate)


def mix64(value: int) -> int:
    """splitmix64's finalizer: nearby inputs (seed, seed + 1, positions) give unrelated outputs."""
    value = (value * 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


_MASK64 = 2**64 - 1


def seed_worker(seed: int, position: int) -> None:
    """Seed a worker's python, numpy and torch streams for the micro-batch at ``position``."""
    value = mix64(mix64(seed) + position)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.default_generator.manual_seed(value % 2**63)


def loader_generator(run: Run) -> torch.Generator:
    """A DataLoader's own generator (its workers' base seed): fixed by (run seed, rank), never
    drawn from the run's global one."""
    seed = mix64(mix64(run.config.run.seed) + run.dist.dp_rank)
    return torch.Generator().manual_seed(seed % 2**63)


EVAL_SEED = 0x5EED
"""Evaluation's worker seeds: another stream of seeds than training's positions."""


def data_loader(
    dataset: Any, sampler: Any, run: Run, persistent: bool = False, seed: int | None = None
) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    """A DataLoader whose sampler yields whole micro-batches ((position, indices), hence
    ``batch_size=None``): its workers read, collate and seed each one (``seed``: training's is
    the run's)."""
    seed = run.config.run.seed if seed is None else seed
    dataset = MicroBatches(dataset, run.datasets.collate_fn, seed)
    return torch.utils.data.DataLoader(
        dataset, batch_size=None, sampler=sampler, persistent_workers=persistent, **loader_settings(run)
    )


class SplitBatches:
    """This rank's micro-batches of a split, on the run's device, each with its sample count —
    what an evaluation (or a prediction) iterates, as many times as it likes.

    A map-style split is read by ``chunks``, this rank's index tensors (one per micro-batch): in
    this process, or by DataLoader workers made once and kept (``data.persistent_workers``). A
    stream is read from its start, this rank's share of it in micro-batches of
    ``micro_batch_size``, up to ``limit`` samples (None: all of it).
    """

    def __init__(
        self,
        run: Run,
        dataset: Any,
        chunks: list[torch.Tensor] | None = None,
        micro_batch_size: int = 1,
        limit: int | None = None,
    ) -> None:
        self.run, self.dataset, self.chunks = run, dataset, chunks or []
        self.micro_batch_size, self.limit = micro_batch_size, limit
        self.device = run.device if run.device.type != "cpu" else None
        self._loader: Any = None
        if run.config.data.num_workers and not is_stream(dataset):
            sampler = [(i, chunk.tolist()) for i, chunk in enumerate(self.chunks)]
            seed = mix64(run.config.run.seed + EVAL_SEED)
            self._loader = data_loader(dataset, sampler, run, run.config.data.persistent_workers, seed)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for count, batch in self._counted():
            yield count, (to_device(batch, self.device) if self.device is not None else batch)

    def _counted(self) -> Iterator[tuple[int, Any]]:
        """(samples, batch), before the move to the device: the count lets an evaluation weight a
        short last batch by what it holds; a stream stops once ``limit`` samples were read."""
        if is_stream(self.dataset):
            seen = 0
            for batch in read_stream(self.run, self.dataset, self.micro_batch_size, training=False):
                if self.limit is not None and seen >= self.limit:
                    return
                seen += batch_size(batch)
                yield batch_size(batch), batch
            return
        collate = self.run.datasets.collate_fn
        source = self._loader if self._loader is not None else (fetch(self.dataset, c, collate) for c in self.chunks)
        yield from ((len(chunk), batch) for chunk, batch in zip(self.chunks, source))


def worker_init_fn(run: Run) -> Callable[[int], None]:
    """What every DataLoader worker of the run does first (picklable, for spawned workers too).

    A scheduler's SIGTERM (``scancel``, a container stop, a node drain) and a terminal's Ctrl-C
    reach the whole process group. The main process turns the signals it watches into an agreed
    checkpoint; a worker must not die of them first, or the main process sees a dead worker
    instead of its next batch (Megatron's ``exit_signal_handler_for_dataloader``). Workers
    still end with the main process: the DataLoader shuts them down, and they watch their
    parent."""
    train = run.config.train
    names = train.exit_signals if train.exit_signal_handler else []
    return functools.partial(_init_worker, tuple(int(getattr(signal, name)) for name in names))


def _init_worker(ignored: tuple[int, ...], worker_id: int) -> None:
    torch.set_num_threads(1)  # workers prepare data; the training process owns the cores
    for signum in ignored:
        signal.signal(signum, signal.SIG_IGN)


class TrainBatches:
    """The training loop's source of micro-batches (on the run's device), one step at a time.

    ``state`` is what :meth:`state_dict` returned when the checkpoint resumed from was saved
    (a stream's position); map-style datasets need none: consumed samples say where they are.
    """

    def __init__(self, run: Run, plan: StepPlan, first_step: int, state: dict[str, Any] | None = None) -> None:
        self.run, self.plan = run, plan
        dataset = run.datasets.train
        self.device = run.device if run.device.type != "cpu" else None
        micro = run.config.train.micro_batch_size
        self._stream: Any = None
        self._reader: BatchReader | None = None
        self._iterator: Iterator[Any] | None = None
        if is_stream(dataset):
            self._stream = read_stream(run, dataset, micro, training=True)
            if state:
                self._stream.load_state_dict(state["loader"])
            self._iterator = iter(self._stream)
            return
        order = SampleOrder(len(dataset), run.config.run.seed, shuffle=not run.datasets.in_order)
        if run.config.data.num_workers == 0:
            self._reader = BatchReader(
                dataset, order, run.dist.dp_rank, run.dist.dp_size, run.device, run.datasets.collate_fn
            )
        else:
            sampler = RankBatchSampler(order, plan, run.dist.dp_rank, run.dist.dp_size, micro, first_step)
            self._iterator = iter(data_loader(dataset, sampler, run))

    def step(self, step: int, n_micro: int, consumed: int) -> list[Any]:
        """The micro-batches of ``step``, which :meth:`StepPlan.at` gave as (n_micro, consumed)."""
        self.plan.forget(step - 1)
        if self._reader is not None:
            micro = self.run.config.train.micro_batch_size
            return self._reader.read(consumed, micro * n_micro * self.run.dist.dp_size, micro)
        assert self._iterator is not None
        batches = [self._next() for _ in range(n_micro)]
        return [to_device(b, self.device) for b in batches] if self.device is not None else batches

    def _next(self) -> Any:
        """The next micro-batch; a finite stream that ended starts its next pass (an epoch), as a
        map-style split's order goes on into its next epoch."""
        assert self._iterator is not None
        try:
            return next(self._iterator)
        except StopIteration:
            if self._stream is None:
                raise
            self._iterator = iter(self._stream)  # a finite stream ended: the next pass over it
            try:
                return next(self._iterator)
            except StopIteration:
                raise UserError(
                    "the train split (a stream) has fewer samples than one micro-batch per rank and worker"
                ) from None

    def state_dict(self) -> dict[str, Any] | None:
        """A stream's position (per rank, per worker) for the checkpoint; None for map-style data."""
        return {"loader": self._stream.state_dict()} if self._stream is not None else None
