"""``streams`` (on by default): how a stream split — an ``IterableDataset``, or anything iterable
without ``__getitem__`` — is read, answering the core's ``read_stream`` hook.

Each rank and each DataLoader worker takes every (ranks × workers)-th item of the stream
(:class:`RankStream`), in micro-batches; in training torchdata's ``StatefulDataLoader`` carries
the position in each worker's stream into the checkpoint — through the stream's own
``state_dict()`` / ``load_state_dict()`` when it has them, else by replaying the stream up to the
saved position. Such a checkpoint resumes on the same number of ranks and workers only; the run
says so at start. Every rank reads the whole stream and keeps its share: a reader that shards by
file (WebDataset, Mosaic streaming) is another plugin answering ``read_stream`` first.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from attrs import define

from coretrain import Run, UserError, hookimpl, is_stream, loader_settings
from coretrain_streams.dataloaders import unwrap_loaders

log = logging.getLogger("coretrain")


class RankStream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The items of a stream that are this rank's and this worker's: every (ranks × workers)-th.

    Its state is the count of stream items passed so far, plus the stream's own state when
    it has one; loading it resumes there (replaying a stream that has no state of its own).
    """

    def __init__(self, stream: Any, rank: int, world_size: int) -> None:
        self.stream, self.rank, self.world = stream, rank, world_size
        self.stateful = callable(getattr(stream, "state_dict", None)) and callable(
            getattr(stream, "load_state_dict", None)
        )
        self._position = 0
        self._resume: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        slots, mine = self.world * workers, self.rank * workers + worker
        start, resume, self._resume = 0, self._resume, None
        if resume is not None:
            start = int(resume["position"])
            if self.stateful and resume.get("stream") is not None:
                self.stream.load_state_dict(resume["stream"])
        items = iter(self.stream)
        if resume is not None and not (self.stateful and resume.get("stream") is not None):
            for _ in range(start):  # no state of its own: replay up to where the checkpoint was
                next(items, None)
        self._position = start
        for item in items:
            self._position += 1
            if (self._position - 1) % slots == mine:
                yield item

    def state_dict(self) -> dict[str, Any]:
        return {"position": self._position, "stream": self.stream.state_dict() if self.stateful else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resume = state


@define
class Streams:
    """Read stream splits: each rank and worker its share, resumable with the same ranks and workers."""

    @hookimpl(tryfirst=True)  # before an adapter (hf-datasets) wraps what a loader held
    def configure_datasets(self, run: Run) -> None:
        """A split handed over as a DataLoader is read as its dataset (:mod:`coretrain_streams.dataloaders`)."""
        unwrap_loaders(run)

    @hookimpl(trylast=True)  # a reader of your own answers first
    def read_stream(self, run: Run, dataset: Any, micro_batch_size: int, training: bool) -> Any:
        loader: Any = torch.utils.data.DataLoader  # an evaluation's pass: from the start, the partial batch kept
        if training:  # checkpointed, each worker's position with it; the partial last batch dropped
            from torchdata.stateful_dataloader import StatefulDataLoader

            loader = StatefulDataLoader
        stream = RankStream(dataset, run.dist.dp_rank, run.dist.dp_size)
        settings = {"collate_fn": run.datasets.collate_fn, "drop_last": training, **loader_settings(run)}
        return loader(stream, batch_size=micro_batch_size, **settings)

    @hookimpl
    def check_resume(self, run: Run, manifest: dict[str, Any]) -> None:
        """A stream's position is saved per rank and per worker: both counts must be the same."""
        if not is_stream(run.datasets.train):
            return
        saved_ranks = manifest.get("world_size", run.dist.world_size)
        saved_workers = (manifest.get("config") or {}).get("data", {}).get("num_workers", run.config.data.num_workers)
        if (saved_ranks, saved_workers) != (run.dist.world_size, run.config.data.num_workers):
            raise UserError(
                f"the train split is a stream, whose position the checkpoint saved per rank and per worker: on "
                f"{saved_ranks} rank(s) with data.num_workers = {saved_workers}, and this run has "
                f"{run.dist.world_size} with {run.config.data.num_workers}; resume with the checkpoint's "
                "counts (a stream's position cannot be redealt to others)"
            )

    @hookimpl
    def on_datasets(self, run: Run) -> None:
        if not (is_stream(run.datasets.train) and run.dist.is_main):
            return
        workers, dp = run.config.data.num_workers, run.dist.dp_size
        if dp * max(workers, 1) == 1:  # one reader reads it in order; a resume with more is refused (check_resume)
            return
        log.warning(
            "the train split is a stream, dealt out item by item to %d reader(s) (ranks × workers), and a "
            "checkpoint resumes exactly only on %d rank(s) with data.num_workers = %d (the stream's position is "
            "saved per rank and worker)",
            dp * max(workers, 1),
            dp,
            workers,
        )
