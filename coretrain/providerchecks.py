"""Checks on what providers hand back: the type the loop needs, before anything uses it.

A provider that returns the wrong thing should be named with what to return, not surface as
an AttributeError deep in the loop. What the datasets hold (lengths, readable samples, token
ids) is the ``data-checks`` plugin's policy; this is only the contract's shape.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from coretrain.errors import UserError
from coretrain.loader import is_stream
from coretrain.run import Datasets


def describe(obj: Any) -> str:
    """An object's type as an error names it: ``pandas.core.frame.DataFrame``, ``dict``."""
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__


def check_model(model: Any, provider: str) -> None:
    """A ``torch.nn.Module`` with something to train (a frozen model would train nothing, silently)."""
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"model.provider '{provider}' returned a {describe(model)}, not a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"model.provider '{provider}': the model has no trainable parameters (check its options)")


def check_datasets(datasets: Any, provider: str) -> None:
    """What the provider handed back is something the loop can read: a Datasets with a train split,
    each split map-style or a stream. Lengths and contents are the ``data-checks`` plugin's."""
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
    if datasets.train is None:
        raise UserError(f"data.provider '{provider}' returned no train split")
    if isinstance(datasets.train, dict):
        raise UserError(
            f"data.provider '{provider}': the train split is a dict ({sorted(map(str, datasets.train))}); return "
            "one of splits named train, validation (or valid) and test; only valid and test may be named sets"
        )
    for split in ("valid", "test"):
        check_named_sets(getattr(datasets, split), f"data.provider '{provider}': Datasets.{split}")
    for split, dataset in [set_ for name in ("train", "valid", "test") for set_ in datasets.sets(name)]:
        if is_stream(dataset):
            continue
        if not hasattr(dataset, "__len__") or not (hasattr(dataset, "__getitem__") or hasattr(dataset, "get_batch")):
            raise UserError(
                f"data.provider '{provider}': the {split} split is a {describe(dataset)}; a dataset is "
                "map-style (__len__ and __getitem__, or get_batch(indices)) or a stream (an IterableDataset, "
                "or anything iterable)"
            )


SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")


def check_named_sets(value: Any, where: str) -> None:
    """Several evaluation sets are a non-empty dict of simple names (they become metric names)."""
    if not isinstance(value, dict):
        return
    if not value:
        raise UserError(f"{where} is an empty dict; give datasets by name, or None")
    for name in value:
        if not isinstance(name, str) or not SET_NAME.fullmatch(name):
            raise UserError(
                f"{where}: the set name {name!r} is not a simple name (letters, digits, _ . -); "
                "names become metrics (valid/NAME/loss)"
            )
