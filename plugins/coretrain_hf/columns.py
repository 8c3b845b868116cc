"""``hf-datasets`` (on by default): a Hugging Face ``datasets.Dataset`` split, read by the batch.

A provider (yours, ``data.provider = "mymodule:build"``, or a plugin) may return Hugging Face
map-style datasets as they come from ``load_dataset`` or ``Dataset.from_dict``. Read sample by
sample they would be python rows collated one by one; this plugin, through the
``configure_datasets`` hook, reads each micro-batch as one Arrow slice in torch format: a dict
of column tensors. A split with a ``data.collate_fn`` is left alone (the function wants
samples), and so is a stream. Importing it imports no ``datasets``: a split is recognised by
its type's module.
"""

from __future__ import annotations

from typing import Any

import torch
from attrs import define

from coretrain import Run, hookimpl, is_stream


class Columns:
    """A Hugging Face ``datasets.Dataset`` read a micro-batch at a time (one Arrow slice per
    batch, as torch tensors), instead of sample by sample."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset.with_format("torch") if dataset.format.get("type") is None else dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(index)]

    def get_batch(self, indices: torch.Tensor) -> Any:
        return self.dataset[indices.tolist()]


def is_hf_dataset(dataset: Any) -> bool:
    return (
        type(dataset).__module__.startswith("datasets.")
        and hasattr(dataset, "with_format")
        and hasattr(dataset, "column_names")
        and not is_stream(dataset)
    )


@define
class HFDatasets:
    """Read Hugging Face map-style splits by the batch (unless a collate_fn wants samples)."""

    @hookimpl
    def configure_datasets(self, run: Run) -> None:
        datasets = run.datasets
        if datasets.collate_fn is not None:
            return
        for split in ("train", "valid", "test"):
            value = getattr(datasets, split)
            if isinstance(value, dict):  # named evaluation sets
                setattr(datasets, split, {name: Columns(d) if is_hf_dataset(d) else d for name, d in value.items()})
            elif value is not None and is_hf_dataset(value):
                setattr(datasets, split, Columns(value))
