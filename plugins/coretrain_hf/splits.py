"""What both text providers share: their files named as Megatron names them, and the split rule
(items, in order, divided by shares)."""

from __future__ import annotations

from typing import Any

from coretrain import FieldValueError


def listed(data_path: Any) -> Any:
    """One file as Megatron's ``--data-path`` takes it (``"data/train.jsonl"``), or a list."""
    return [data_path] if isinstance(data_path, str) else data_path


def check_shares(split: list[float]) -> None:
    if len(split) != 3 or sum(split) <= 0:
        raise FieldValueError("split", f"needs three shares (train, valid, test), summing above 0; got {split}")


def bounds(count: int, shares: list[float]) -> list[tuple[int, int]]:
    """[start, end) of train, valid and test among ``count`` items, in order, by ``shares``."""
    total = sum(shares)
    edges = [0]
    for share in shares[:-1]:
        edges.append(min(edges[-1] + round(count * share / total), count))
    edges.append(count)
    return list(zip(edges, edges[1:]))
