"""Evaluation: the model's loss and named values over a split, averaged over every sample.

Two ways, chosen by ``train.eval_full``:

- a full pass: every sample of the split exactly once, rank r taking samples r, r+W, r+2W…
  in micro-batches of ``train.eval_micro_batch_size``; the last, partial micro-batch counts
  for the samples it has;
- ``train.eval_iters`` global batches drawn from a seeded order, the same ones every time
  (comparable from one validation to the next, and cheap on a large split).

Values are summed weighted by the micro-batch's sample count and reduced over ranks with
one collective, so the result is the mean over samples whatever the batch sizes and the
number of ranks. ``ppl`` is reported for token-level losses only (datasets with a seq_length).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coretrain.run import Run

import contextlib
import math
from collections.abc import Iterable
from typing import Any

import torch

from coretrain import outputs
from coretrain.data import SampleOrder, batch_size, fetch, to_device
from coretrain.dist import sum_over_ranks
from coretrain.loader import MicroBatches, is_stream, stream_loader, worker_init_fn

EVAL_SEED_OFFSET = 1_000_003


def index_chunks(run: Run, length: int) -> list[torch.Tensor]:
    """This rank's micro-batches of sample indices for one evaluation of a split of ``length``."""
    train, rank, world = run.config.train, run.dist.dp_rank, run.dist.dp_size
    micro = train.eval_micro_batch_size or train.micro_batch_size
    if train.eval_full:
        return list(torch.split(torch.arange(rank, length, world), micro))
    order = SampleOrder(length, run.config.run.seed + EVAL_SEED_OFFSET)
    global_batch = run.global_batch_size
    per_rank = global_batch // world
    return [
        chunk
        for i in range(train.eval_iters)
        for chunk in torch.split(order.indices(i * global_batch + rank * per_rank, per_rank), micro)
    ]


class Evaluator:
    """Evaluates one split; its index chunks and DataLoader workers are made once and reused.

    A stream split is read from its start each time, this rank's share of it: all of it
    with ``eval_full``, else its first ``eval_iters`` global batches' worth.
    """

    def __init__(self, run: Run, dataset: Any, split: str) -> None:
        self.run, self.dataset, self.split = run, dataset, split
        self.stream = is_stream(dataset)
        self.chunks = [] if self.stream else index_chunks(run, len(dataset))
        self._loader: Any = None
        if run.config.data.num_workers and not self.stream:
            cfg = run.config.data
            self._loader = torch.utils.data.DataLoader(
                MicroBatches(dataset, run.datasets.collate_fn),
                batch_size=None,
                sampler=[chunk.tolist() for chunk in self.chunks],
                num_workers=cfg.num_workers,
                prefetch_factor=cfg.prefetch_factor,
                pin_memory=cfg.pin_memory and run.device.type == "cuda",
                persistent_workers=cfg.persistent_workers,
                worker_init_fn=worker_init_fn(run),
            )

    def _batches(self) -> Iterable[tuple[int, Any]]:
        run = self.run
        device = run.device if run.device.type != "cpu" else None
        if self.stream:
            train = run.config.train
            limit = None if train.eval_full else train.eval_iters * run.global_batch_size // run.dist.dp_size
            seen = 0
            for batch in stream_loader(
                self.dataset, run, train.eval_micro_batch_size or train.micro_batch_size, stateful=False
            ):
                if limit is not None and seen >= limit:
                    return
                seen += batch_size(batch)
                yield batch_size(batch), (to_device(batch, device) if device is not None else batch)
            return
        source = (
            self._loader
            if self._loader is not None
            else (fetch(self.dataset, chunk, run.datasets.collate_fn) for chunk in self.chunks)
        )
        for chunk, batch in zip(self.chunks, source):
            yield len(chunk), (to_device(batch, device) if device is not None else batch)

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        run = self.run
        model = run.model
        was_training = model.training
        model.eval()
        totals: dict[str, torch.Tensor] = {}
        samples = 0
        try:
            for count, batch in self._batches():
                samples += count
                with autocast(run):
                    loss, extras = outputs.call(model, batch, run.loss_fn)
                tokens = extras.get(outputs.NUM_TOKENS)
                for name, value in {"loss": loss, **extras}.items():
                    if name == outputs.NUM_TOKENS:
                        continue
                    weight = tokens if name == "loss" and tokens is not None else count
                    weighted = value.detach().float().reshape(()) * weight
                    totals[name] = totals[name] + weighted if name in totals else weighted
                if tokens is not None:  # the loss is per token: its normaliser is the tokens, not the samples
                    totals["_tokens"] = totals.get("_tokens", torch.zeros((), device=tokens.device)) + tokens.float()
        finally:
            model.train(was_training)
        names = sorted(totals)
        sample_count = torch.tensor(float(samples), device=run.device)
        summed = sum_over_ranks(torch.stack([sample_count, *(totals[n].to(run.device) for n in names)])).tolist()
        sums = dict(zip(names, summed[1:]))
        tokens = sums.pop("_tokens", None)
        metrics = {f"{self.split}/{name}": value / summed[0] for name, value in sums.items()}
        if tokens:
            metrics[f"{self.split}/loss"] = sums["loss"] / tokens
        if run.datasets.seq_length:  # a token-level loss: its exponential is the perplexity
            metrics[f"{self.split}/ppl"] = math.exp(min(metrics[f"{self.split}/loss"], 50.0))
        return metrics


def autocast(run: Run) -> contextlib.AbstractContextManager[Any]:
    precision = run.config.run.precision
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(run.device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)
