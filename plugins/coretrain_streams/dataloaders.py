"""A split handed over as a ``torch.utils.data.DataLoader``, as a training script holds its data:
read as the loader's dataset, in coretrain's own order.

A loader is iterable, so it looked like a stream of samples whose items were whole batches, and
the run ended with "fewer samples than one micro-batch". Its dataset is read as any split is —
seeded, resumable on any number of ranks — in micro-batches of ``train.micro_batch_size``, with
``data.num_workers``, collated by the loader's own ``collate_fn``. A sampler that only shuffles or
shards over ranks (``DistributedSampler``, as a DDP script holds) is what that order does itself.
One that chooses samples its own way (weighted, a subset), a ``batch_sampler`` that makes batches
its own way (by length) and ``batch_size=None`` (a dataset whose items are whole batches) cannot be
followed by that order: one error, not a silent change of what the model sees.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from coretrain import Run, UserError

log = logging.getLogger("coretrain")

ORDERS = (torch.utils.data.RandomSampler, torch.utils.data.SequentialSampler, torch.utils.data.DistributedSampler)
"""Samplers that only shuffle, keep the order or shard over ranks: coretrain's order stands in for them."""


def unwrap_loaders(run: Run) -> None:
    """Replace every DataLoader split of ``run.datasets`` by its dataset; say once what of the
    loaders is not used, where it differs from the run's settings."""
    datasets, loaders = run.datasets, {}
    for split in ("train", "valid", "test"):
        for name, value in datasets.sets(split):
            if isinstance(value, torch.utils.data.DataLoader):
                loaders[name] = value
    if not loaders:
        return
    for name, loader in loaders.items():
        unfollowed, instead = unfollowed_batching(loader)
        if unfollowed:
            raise UserError(
                f"data.provider '{run.config.data.provider}': the {name} split is a DataLoader {unfollowed}, which "
                f"coretrain's order (seeded, resumable on any number of ranks) cannot follow; {instead}"
            )
    collates = {loader.collate_fn for loader in loaders.values()} - {torch.utils.data.default_collate}
    if len(collates) > 1:
        raise UserError(
            f"data.provider '{run.config.data.provider}': the DataLoaders collate with {len(collates)} different "
            "collate_fn; a run has one: set data.collate_fn"
        )
    if collates and datasets.collate_fn is None:
        datasets.collate_fn = collates.pop()
    for split in ("train", "valid", "test"):
        value = getattr(datasets, split)
        if isinstance(value, dict):
            setattr(datasets, split, {key: unwrapped(item) for key, item in value.items()})
        else:
            setattr(datasets, split, unwrapped(value))
    if run.dist.is_main:
        log.warning(said(run, loaders))


def unfollowed_batching(loader: torch.utils.data.DataLoader[Any]) -> tuple[str, str]:
    """How ``loader`` chooses or batches samples beyond an order coretrain's stands in for, and
    what to return instead; ``("", "")`` when nothing."""
    batches = loader.batch_sampler
    if batches is None:  # no automatic batching: the loader hands the dataset's items over as they are
        return (
            "with batch_size=None, whose dataset's items are whole batches",
            "return a dataset of single samples (train.micro_batch_size makes the batches)",
        )
    if type(batches) is not torch.utils.data.BatchSampler:
        return (
            f"whose batch_sampler ({type(batches).__name__}) makes batches its own way",
            "return the dataset (micro-batches of train.micro_batch_size samples, in coretrain's order)",
        )
    iterable = isinstance(loader.dataset, torch.utils.data.IterableDataset)
    if not iterable and not isinstance(loader.sampler, ORDERS):
        return (
            f"whose sampler ({type(loader.sampler).__name__}) chooses samples its own way",
            "return the dataset, with the choice made in it",
        )
    return "", ""


def unwrapped(value: Any) -> Any:
    return value.dataset if isinstance(value, torch.utils.data.DataLoader) else value


def said(run: Run, loaders: dict[str, Any]) -> str:
    """The one line: that the datasets are read, and each loader setting the run does not follow."""
    train, workers = run.config.train, run.config.data.num_workers
    ignored = []
    for name, loader in loaders.items():
        size = train.micro_batch_size if name == "train" else (train.eval_micro_batch_size or train.micro_batch_size)
        if loader.batch_size not in (None, size):
            ignored.append(f"{name} batch_size {loader.batch_size} (micro-batches of {size} here)")
        if loader.num_workers != workers:
            ignored.append(f"{name} num_workers {loader.num_workers} (data.num_workers = {workers})")
    rest = f"; not used: {', '.join(ignored)}" if ignored else ""
    return (
        f"data.provider '{run.config.data.provider}' gave DataLoaders ({', '.join(loaders)}): their datasets are "
        f"read in coretrain's own order (seeded, resumable on any number of ranks), with their collate_fn{rest}"
    )
