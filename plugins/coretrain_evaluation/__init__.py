"""``evaluation`` (on by default): the model's loss and named values over a split, averaged over
every sample — the ``evaluate`` hook's built-in answer, which a plugin of yours may replace.

Two ways, chosen by ``train.eval_full``:

- a full pass: every sample of the split exactly once, rank r taking samples r, r+W, r+2W…
  in micro-batches of ``train.eval_micro_batch_size``; the last, partial micro-batch counts
  for the samples it has;
- ``train.eval_iters`` global batches drawn from a seeded order, the same ones every time
  (comparable from one validation to the next, and cheap on a large split).

A stream split is read from its start each time: all of this rank's share with ``eval_full``,
else its first ``eval_iters`` global batches' worth. Values are summed weighted by the
micro-batch's sample count (the loss by its tokens when the model reports ``num_tokens``) and
reduced over ranks with one collective, so the result is the mean over samples whatever the
batch sizes and the number of ranks. ``ppl`` is reported for token-level losses only
(datasets with a seq_length).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from attrs import define, field

from coretrain import (
    NUM_TOKENS,
    Run,
    SampleOrder,
    SplitBatches,
    UserError,
    forward,
    hookimpl,
    is_stream,
    sum_over_ranks,
)
from coretrain_evaluation.corpus import Collected, import_metrics

if TYPE_CHECKING:
    from coretrain_evaluation.hookspecs import EvaluationSpecs

log = logging.getLogger("coretrain")

EVAL_SEED_OFFSET = 1_000_003


UNCOUNTED = torch.zeros(1, dtype=torch.long)
"""The micro-batch a rank with a shorter share runs to stay in step with the others (sample 0,
its result left out)."""


def index_chunks(run: Run, length: int, block: int = 0) -> list[torch.Tensor]:
    """This rank's micro-batches of sample indices for one evaluation of a split of ``length``:
    its ``block``-th ``eval_iters`` global batches.

    Every rank reads as many: the forward of a sharded or expert-parallel model is a collective,
    and a rank that ran one more would wait for the others forever. With ``eval_full`` a rank
    whose share is a micro-batch shorter than the first rank's reads sample 0 once more at the
    end, run but not counted (:data:`UNCOUNTED`)."""
    train, rank, world = run.config.train, run.dist.dp_rank, run.dist.dp_size
    micro = train.eval_micro_batch_size or train.micro_batch_size
    if train.eval_full:
        chunks = list(torch.split(torch.arange(rank, length, world), micro))
        most = -(-len(range(0, length, world)) // micro)  # the first rank's share is the longest
        return chunks + [UNCOUNTED] * (most - len(chunks))
    order = SampleOrder(length, run.config.run.seed + EVAL_SEED_OFFSET, shuffle=not run.datasets.in_order)
    global_batch = eval_global_batch(run)
    per_rank = global_batch // world
    first = block * train.eval_iters
    return [
        chunk
        for i in range(first, first + train.eval_iters)
        for chunk in torch.split(order.indices(i * global_batch + rank * per_rank, per_rank), micro)
    ]


def eval_global_batch(run: Run) -> int:
    """The global batch an evaluation reads in: the configured one, as Megatron's (its validation
    batch does not follow a batch-size rampup), so what an evaluation reads never depends on
    the batch of the step it runs at — nor on where a resumed run's first evaluation falls."""
    per_pass = run.samples_per_micro_batch
    configured = run.config.train.global_batch_size or per_pass
    return max(configured // per_pass, 1) * per_pass


def block_of(run: Run, split: str) -> int:
    """Which ``eval_iters`` global batches this evaluation reads: always the first, except for the
    valid split of a dataset in training order (Megatron's), which moves on through them as
    Megatron's validation iterator does — the evaluation at step s reads block ⌈s / eval_interval⌉ − 1,
    so a resumed run reads what an uninterrupted one would."""
    interval = run.cadence.eval_every
    if not (run.datasets.in_order and split.startswith("valid") and interval):
        return 0
    return max(run.state.step - 1, 0) // interval


def split_batches(run: Run, dataset: Any, block: int = 0) -> SplitBatches:
    train = run.config.train
    micro = train.eval_micro_batch_size or train.micro_batch_size
    if is_stream(dataset):
        limit = None if train.eval_full else train.eval_iters * eval_global_batch(run) // run.dist.dp_size
        return SplitBatches(run, dataset, micro_batch_size=micro, limit=limit)
    return SplitBatches(run, dataset, index_chunks(run, len(dataset), block))


@torch.no_grad()
def evaluate_split(
    run: Run,
    batches: SplitBatches,
    split: str,
    collected: Collected | None = None,
) -> dict[str, float]:
    """``SPLIT/NAME`` means over every sample the ranks read, with one collective; and
    with ``collected``, ``compute_metrics``' metrics of the whole split (:mod:`coretrain_evaluation.corpus`)."""
    model = run.model
    own = (
        cast("EvaluationSpecs", run.plugins.calls.hook).forward_batch
        if run.plugins.implemented("forward_batch")
        else None
    )
    was_training = model.training
    model.eval()
    totals: dict[str, torch.Tensor] = {}
    samples = 0
    if collected is not None:
        collected.start()
    try:
        for chunk, (count, batch) in zip(batches.chunks or itertools.repeat(None), batches):
            loss, extras = (own(run=run, batch=batch) if own else None) or forward(run, batch)
            if collected is not None:
                collected.add(batch, chunk, counted=chunk is not UNCOUNTED)
            if chunk is UNCOUNTED:  # run to keep this rank in step with the others, not counted
                continue
            samples += count
            tokens = extras.pop(NUM_TOKENS, None)
            for name, value in {"loss": loss, **extras}.items():
                weight = tokens if name == "loss" and tokens is not None else count
                weighted = value.detach().float().reshape(()) * weight
                totals[name] = totals[name] + weighted if name in totals else weighted
            if tokens is not None:  # the loss is per token: its normaliser is the tokens, not the samples
                totals["_tokens"] = totals.get("_tokens", torch.zeros((), device=tokens.device)) + tokens.float()
    finally:
        model.train(was_training)
        if collected is not None:
            collected.stop()
    names = sorted(totals)
    sample_count = torch.tensor(float(samples), device=run.device)
    summed = sum_over_ranks(torch.stack([sample_count, *(totals[n].to(run.device) for n in names)])).tolist()
    sums = dict(zip(names, summed[1:]))
    tokens = sums.pop("_tokens", None)
    metrics = {f"{split}/{name}": value / summed[0] for name, value in sums.items()}
    if tokens:
        metrics[f"{split}/loss"] = sums["loss"] / tokens
    if run.datasets.seq_length:  # a token-level loss: its exponential is the perplexity
        metrics[f"{split}/ppl"] = math.exp(min(metrics[f"{split}/loss"], 50.0))
    if collected is not None:
        metrics.update(collected.metrics(run, split))
    return metrics


@define(kw_only=True)
class Evaluation:
    """The loss and the model's named values over the valid split (and test after training)."""

    compute_metrics: str | None = None
    """``package.module:function`` called after each evaluation of a split as ``function(predictions,
    labels)``, with the model's outputs (its logits) and the targets of every sample evaluated —
    over all ranks, in sample order — returning metrics by name, logged as ``valid/NAME``: F1, AUC,
    what a mean over batches cannot give (the Hugging Face Trainer's ``compute_metrics``)."""
    _batches: dict[str, tuple[int, SplitBatches]] = field(factory=dict, init=False, repr=False)
    _metrics: Callable[..., Any] | None = field(default=None, init=False, repr=False)
    _collected: Collected | None = field(default=None, init=False, repr=False)

    @hookimpl(trylast=True)  # a plugin of yours that evaluates answers first
    def evaluate(self, run: Run, split: str, dataset: Any) -> dict[str, float] | None:
        train = run.config.train
        if not (train.eval_full or train.eval_iters):
            return None
        block = 0 if train.eval_full else block_of(run, split)
        if self._batches.get(split, (None,))[0] != block:  # index chunks and workers made once, reused
            self._batches[split] = (block, split_batches(run, dataset, block))
        if self._metrics is not None and self._collected is None:
            self._collected = Collected(run.model, self._metrics)
        return evaluate_split(run, self._batches[split][1], split, self._collected)

    @hookimpl
    def on_datasets(self, run: Run) -> None:
        """A config that asks for validation during training from data without a validation split
        (a provider that made none, an ``indexed`` split whose valid share rounds to no document)
        is said once, instead of a run that silently never validates (``config validate`` says it
        too)."""
        if self.compute_metrics is not None:
            if run.dist.cp_size > 1 or run.plugins.implemented("forward_batch"):  # the same on every rank
                raise UserError(
                    "plugins.evaluation.compute_metrics: each sample's outputs are split over ranks (context or "
                    "pipeline parallelism), and compute_metrics needs them whole on one rank; evaluate without it"
                )
            self._metrics = import_metrics(self.compute_metrics)
        train = run.config.train
        asks = bool(train.eval_interval) and bool(train.eval_full or train.eval_iters)
        if not asks or run.datasets.sets("valid") or not run.dist.is_main:
            return
        fix = "give the data a valid split, or unset train.eval_interval"
        if run.datasets.sets("test"):  # datasets' train_test_split names its held-out part "test"
            fix = (
                "its test split is evaluated once, at the end; to evaluate it during training, return it as the "
                "validation split: {'train': splits['train'], 'validation': splits['test']}"
            )
        log.warning(
            "train.eval_interval = %d, but data.provider %r gave no validation split: nothing is evaluated "
            "during training (%s)",
            train.eval_interval,
            run.config.data.provider,
            fix,
        )

    @hookimpl
    def on_train_end(self) -> None:
        """Let go of the DataLoader workers kept between evaluations, so the process can exit, and
        of the forward hook ``compute_metrics`` reads the outputs by."""
        self._batches.clear()
        if self._collected is not None:
            self._collected.close()
            self._collected = None
