"""``hf-datasets`` (on by default): a Hugging Face ``datasets.Dataset`` split, read by the batch.

A provider (yours, ``data.provider = "mymodule:build"``, or a plugin) may return Hugging Face
map-style datasets as they come from ``load_dataset`` or ``Dataset.from_dict``. Read sample by
sample they would be python rows collated one by one; this plugin, through the
``configure_datasets`` hook, reads each micro-batch as one Arrow slice in torch format: a dict
of column tensors. A split with a ``data.collate_fn`` is left alone (the function wants
samples). A stream (``streaming=True``, ``to_iterable_dataset()``) is read row by row in torch
format, its rows collated as a map-style split's batches are made (:class:`Padding`, the run's
``collate_fn`` when the data gives none). Importing it imports no ``datasets``: a split is
recognised by its type's module.

Token columns of different lengths (``tokenizer(text)`` without ``padding="max_length"``) are
padded per micro-batch with the run's tokenizer (``[tokenizer]``), as transformers'
``DataCollatorWithPadding`` pads them for its ``Trainer``, and per-token labels with -100; without
a tokenizer, such a batch is one error that says how to pad it. A ``label`` (or ``label_ids``)
column reaches the model as ``labels``, as that collator renames it: a Hugging Face model of
yours computes its loss from it. A split's own transform (``with_transform``: an image
processor's ``pixel_values``) is applied to each micro-batch, and the python lists it gives are
made into tensors as transformers' ``default_data_collator`` makes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from attrs import define
from coretrain_tokenizer import handed_tokenizer

from coretrain import Run, UserError, hookimpl, is_stream
from coretrain_hf.model import IGNORE_INDEX, LABEL_KEYS

SPLITS = ("train", "valid", "test")


class Padding:
    """A batch's columns as transformers' ``default_data_collator`` makes them (:func:`collated`),
    token columns of different lengths padded with the run's ``tokenizer`` (an attention mask of 0
    over the padding) as ``DataCollatorWithPadding`` pads them, per-token labels with -100, and
    ``label`` renamed ``labels``; ``split`` names the split in what is wrong with it. Called on a
    stream's rows, it is their collate: a Hugging Face stream is padded as its map-style split is."""

    def __init__(self, split: str, tokenizer: Any) -> None:
        self.split, self.tokenizer = split, tokenizer

    def __call__(self, rows: list[Any]) -> Any:
        """A stream's rows (torch-format dicts) as one batch; rows of another kind by torch's default collate."""
        if not rows or not isinstance(rows[0], Mapping):
            return torch.utils.data.default_collate(rows)
        return self.batch({name: [row[name] for row in rows] for name in rows[0]})

    def batch(self, columns: Mapping[str, Any]) -> dict[str, Any]:
        batch = {name: collated(column) for name, column in columns.items()}
        # torch format gives a column of uneven sequences as a list of tensors (strings stay a list of str)
        ragged = [name for name, value in batch.items() if isinstance(value, list) and is_tensors(value)]
        return as_labels(self._padded(batch, ragged) if ragged else batch)

    def _padded(self, batch: dict[str, Any], ragged: list[str]) -> dict[str, Any]:
        """The batch with its token columns padded by the run's tokenizer (and an attention
        mask of 0 over the padding), as ``DataCollatorWithPadding`` pads them, and per-token
        labels with -100, the index every loss ignores (as ``DataCollatorForSeq2Seq``)."""
        if self.tokenizer is None:
            raise UserError(
                f'{self._uneven(batch, ragged[0])}; set [tokenizer] path = "DIR" to pad them with its pad token '
                '(as transformers\' DataCollatorWithPadding does), or tokenize with padding="max_length", or set '
                "data.collate_fn"
            )
        if self.tokenizer.pad_token is None:
            raise UserError(
                f"{self._uneven(batch, ragged[0])}, and the run's tokenizer has no pad token: give it one "
                "(tokenizer.pad_token = tokenizer.eos_token, then save_pretrained), or tokenize with "
                'padding="max_length"'
            )
        labels = {name: batch.pop(name) for name in ragged if name in LABEL_KEYS}  # per-token: -100 is ignored
        kept = {name: batch.pop(name) for name in list(batch) if not is_tensors(batch[name])}  # strings: as they are
        try:
            padded = dict(self.tokenizer.pad(batch, return_tensors="pt"))
        except ValueError:  # a ragged column the tokenizer does not pad
            inputs = list(self.tokenizer.model_input_names)
            others = [name for name in ragged if name not in inputs and name not in labels]
            raise UserError(
                f"the {self.split} split's columns {others} hold sequences of different lengths, which the "
                f"tokenizer does not pad (it pads {inputs}, and labels are padded with {IGNORE_INDEX}); pad them "
                "in the dataset, drop them (remove_columns), or set data.collate_fn"
            ) from None
        side = self.tokenizer.padding_side
        return padded | kept | {name: padded_rows(rows, IGNORE_INDEX, side) for name, rows in labels.items()}

    def _uneven(self, batch: dict[str, Any], name: str) -> str:
        """What is wrong with the column ``name``, for the error that refuses the batch."""
        lengths = sorted({len(row) for row in batch[name]})
        shown = ", ".join(map(str, lengths[:4])) + (", ..." if len(lengths) > 4 else "")
        return f"the {self.split} split's column '{name}' holds sequences of different lengths ({shown})"


class Columns:
    """A Hugging Face ``datasets.Dataset`` read a micro-batch at a time (one Arrow slice per
    batch, as torch tensors), instead of sample by sample; ``tokenizer`` pads token columns of
    different lengths, and ``split`` names the split when there is none to pad them."""

    def __init__(self, dataset: Any, split: str = "train", tokenizer: Any = None) -> None:
        self.dataset = dataset.with_format("torch") if dataset.format.get("type") is None else dataset
        self.padding = Padding(split, tokenizer)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[int(index)]

    def get_batch(self, indices: torch.Tensor) -> Any:
        return self.padding.batch(self.dataset[indices.tolist()])


def as_labels(batch: dict[str, Any]) -> dict[str, Any]:
    """The target column under the name a Hugging Face model takes it by: ``label`` (what
    ``load_dataset`` names a class) or ``label_ids`` becomes ``labels``, as transformers'
    ``DataCollatorWithPadding`` and ``default_data_collator`` rename it for the ``Trainer``."""
    for name in ("label", "label_ids"):
        if name in batch and "labels" not in batch:
            batch["labels"] = batch.pop(name)
    return batch


def collated(column: Any) -> Any:
    """A column of a batch as transformers' ``default_data_collator`` makes it, for a split whose
    own transform (``with_transform``, an image processor's) gives python lists: tensors of one
    shape stacked, numbers as one tensor (ints as int64, as it makes class labels); anything
    else as it is (strings; sequences of different lengths, padded next)."""
    if not isinstance(column, list) or not column:
        return column
    first = column[0]
    if torch.is_tensor(first) and all(torch.is_tensor(row) and row.shape == first.shape for row in column):
        return torch.stack(column)
    if all(isinstance(row, (int, float)) and not isinstance(row, bool) for row in column):
        return torch.tensor(column)
    return column


def is_tensors(column: Any) -> bool:
    """A column of tensors: one tensor, or a list of them (uneven sequences)."""
    return torch.is_tensor(column) or (isinstance(column, list) and bool(column) and torch.is_tensor(column[0]))


def padded_rows(rows: list[torch.Tensor], value: int, side: str) -> torch.Tensor:
    """Rows of different lengths as one tensor, padded with ``value`` on ``side`` to the longest."""
    longest = max(len(row) for row in rows)
    out = torch.full((len(rows), longest), value, dtype=rows[0].dtype)
    for i, row in enumerate(rows):
        start = longest - len(row) if side == "left" else 0
        out[i, start : start + len(row)] = row
    return out


def is_hf_stream(dataset: Any) -> bool:
    """A Hugging Face ``IterableDataset`` (``streaming=True``, ``to_iterable_dataset``)."""
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "with_format") and is_stream(dataset)


def torch_stream(dataset: Any) -> Any:
    """A Hugging Face stream yielding torch tensors, as a ``Dataset`` split is read (its python
    rows would collate a list column into a list of tensors), its ``label`` column as ``labels``."""
    if getattr(dataset, "_formatting", None) is None:  # unformatted: python rows
        dataset = dataset.with_format("torch")
    names = dataset.column_names or []  # unknown for some streams until read
    old = next((name for name in LABEL_KEYS[1:] if name in names), None)
    return dataset.rename_column(old, "labels") if old and "labels" not in names else dataset


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
        every = [dataset for split in SPLITS for _, dataset in datasets.sets(split)]
        streams = any(is_hf_stream(dataset) for dataset in every)  # (their columns may be known only once read)
        uneven = streams or any(is_hf_dataset(dataset) and has_sequences(dataset) for dataset in every)
        tokenizer = handed_tokenizer(run, "padding the token columns of a datasets split") if uneven else None
        if streams:  # read row by row: their collate pads them as a map-style split's batches are
            datasets.collate_fn = Padding("streamed", tokenizer)

        def read(dataset: Any, split: str) -> Any:
            if is_hf_stream(dataset):
                return torch_stream(dataset)
            return Columns(dataset, split, tokenizer) if is_hf_dataset(dataset) else dataset

        for split in SPLITS:
            value = getattr(datasets, split)
            if isinstance(value, dict):  # named evaluation sets
                setattr(datasets, split, {name: read(d, f"{split}/{name}") for name, d in value.items()})
            elif value is not None:
                setattr(datasets, split, read(value, split))


def has_sequences(dataset: Any) -> bool:
    """A column of sequences without a fixed length (``List``, or ``Sequence`` of ``datasets`` 3)."""
    return any(getattr(feature, "length", None) == -1 for feature in dataset.features.values())
