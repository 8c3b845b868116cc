"""``data-checks`` (on by default): every split is read once before the first step.

A run that fails in its final validation loses everything it trained; a dataset that lies
about its length fails hours in. So before training each map-style split is asked: is it long
enough for one global batch (valid/test: for one evaluation), can its first and last samples
be read, are its token ids inside the vocabulary. Each failure is one :class:`UserError`
naming the split and what to change. Streams are read in order and not checked. That the
provider handed back a dataset at all is the core's check, not this plugin's.
Turn it off with ``[plugins.data-checks] enabled = false`` (a split too large to index twice).
"""

from __future__ import annotations

from typing import Any

import torch
from attrs import define

from coretrain import Run, UserError, fetch, hookimpl, is_stream


@define
class DataChecks:
    """Check every split's length, first and last samples and token ids once, before training."""

    @hookimpl
    def on_datasets(self, run: Run) -> None:
        train, datasets = run.config.train, run.datasets
        # a full pass needs a sample per rank; eval_iters batches need one global batch
        eval_needed = run.dist.dp_size if train.eval_full else run.global_batch_size if train.eval_iters else 1
        for split, dataset in [named for name in ("train", "valid", "test") for named in datasets.sets(name)]:
            if is_stream(dataset):
                continue
            needed = run.global_batch_size if split == "train" else eval_needed
            check_split(dataset, split, run.config.data.provider, needed, min(train.micro_batch_size, needed), datasets)


def check_split(dataset: Any, split: str, provider: str, needed: int, micro_batch: int, datasets: Any) -> None:
    """Length, first micro-batch, last sample, token ids of one map-style split."""
    where = f"data.provider '{provider}': the {split} split"
    try:
        length = len(dataset)
    except Exception as exc:
        raise UserError(f"{where}: len() failed: {type(exc).__name__}: {exc}") from None
    if length < needed:
        if split == "train":
            fix = "lower train.global_batch_size / micro_batch_size or give it more data"
        else:
            fix = "lower the batch size, give it more data, or set train.eval_full = true or train.eval_iters = 0"
        raise UserError(
            f"{where} has {length} sample(s), fewer than {needed} (one global batch, or a sample "
            f"per rank for a full pass): {fix}"
        )
    for indices in (torch.arange(micro_batch), torch.arange(length - 1, length)):
        try:
            batch = fetch(dataset, indices, datasets.collate_fn)
        except Exception as exc:
            cause = str(exc) if isinstance(exc, UserError) else f"{type(exc).__name__}: {exc}"  # a reader's own words
            raise UserError(f"{where}: cannot read samples {indices.tolist()[:4]} of {length}: {cause}") from None
        if datasets.vocab_size is not None:
            check_token_ids(batch, datasets.vocab_size, where)


def check_token_ids(batch: Any, vocab_size: int, where: str) -> None:
    """Integer tensors of the batch hold ids below ``vocab_size`` (negative ones are ignore-indices)."""
    tensors = batch if isinstance(batch, (list, tuple)) else batch.values() if isinstance(batch, dict) else [batch]
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.is_floating_point() or tensor.dtype == torch.bool:
            continue
        high = int(tensor.max()) if tensor.numel() else -1
        if high >= vocab_size:
            raise UserError(
                f"{where} holds token id {high}, outside the vocabulary (vocab_size {vocab_size}): "
                "a wrong dtype for the token file, or a tokenizer that does not match?"
            )
