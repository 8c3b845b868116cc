"""Checks on what providers hand back, run once before the first step.

A run that fails in its final validation loses everything it trained; a dataset that lies
about its length fails hours in. So before training, every split is asked once: is it a
dataset, is it long enough for one global batch, can a first and a last sample be read, are
its token ids inside the vocabulary. Each failure is one :class:`UserError` naming the split
and what to change.
"""

from __future__ import annotations

from typing import Any

import torch

from coretrain.data import fetch
from coretrain.errors import UserError


def describe(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__


def check_model(model: Any, provider: str) -> None:
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model.provider '{provider}' returned a {describe(model)}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(
            f"model.provider '{provider}': the model has no trainable parameters "
            "(check the model options, e.g. a layer count of 0)"
        )


def check_datasets(datasets: Any, provider: str, *, global_batch: int, micro_batch: int, eval_needed: int) -> None:
    """Fail before training on datasets the loop could not read to the end.

    ``eval_needed``: samples the valid and test splits must have (one global batch for
    ``eval_iters`` batches, one per rank for a full pass)."""
    from coretrain.run import Datasets

    if not isinstance(datasets, Datasets):
        raise UserError(
            f"data.provider '{provider}' returned a {describe(datasets)}; return coretrain's Datasets, "
            "a dataset, or a (train, valid, test) tuple"
        )
    for name in ("seq_length", "vocab_size"):
        value = getattr(datasets, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
            raise UserError(
                f"data.provider '{provider}': Datasets.{name} must be a positive integer or None, got {value!r}"
            )
    for split in ("train", "valid", "test"):
        dataset = getattr(datasets, split)
        if dataset is None:
            if split == "train":
                raise UserError(f"data.provider '{provider}' returned no train split")
            continue
        needed = global_batch if split == "train" else eval_needed
        _check_split(
            dataset, split, provider, needed, min(micro_batch, needed), datasets.vocab_size, datasets.collate_fn
        )


def _check_split(
    dataset: Any, split: str, provider: str, needed: int, micro_batch: int, vocab_size: int | None, collate: Any
) -> None:
    from coretrain.loader import is_stream

    where = f"data.provider '{provider}': the {split} split"
    if is_stream(dataset):  # read in order: nothing to count or index before training
        return
    if not hasattr(dataset, "__len__") or not (hasattr(dataset, "__getitem__") or hasattr(dataset, "get_batch")):
        raise UserError(
            f"{where} is a {describe(dataset)}; a dataset is map-style (__len__ and __getitem__, or "
            "get_batch(indices)) or a stream (an IterableDataset, or anything iterable)"
        )
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
            batch = fetch(dataset, indices, collate)
        except Exception as exc:
            raise UserError(
                f"{where}: cannot read samples {indices.tolist()[:4]} of {length}: {type(exc).__name__}: {exc}"
            ) from None
        if vocab_size is not None:
            _check_token_ids(batch, vocab_size, where)


def _check_token_ids(batch: Any, vocab_size: int, where: str) -> None:
    tensors = batch if isinstance(batch, (list, tuple)) else batch.values() if isinstance(batch, dict) else [batch]
    for tensor in tensors:
        if (
            isinstance(tensor, torch.Tensor)
            and not tensor.is_floating_point()
            and tensor.numel()
            and tensor.dtype != torch.bool
        ):
            high = int(tensor.max())  # negative ids are ignore-indices (-100), not errors
            if high >= vocab_size:
                raise UserError(
                    f"{where} holds token id {high}, outside the "
                    f"vocabulary (vocab_size {vocab_size}): a wrong dtype for the token file, or a "
                    "tokenizer that does not match?"
                )
