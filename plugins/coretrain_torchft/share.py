"""A replica group's share of the train split: every ``groups``-th sample, from its own on."""

from __future__ import annotations

from typing import Any

import torch

from coretrain import UserError


class GroupShare:
    """Every ``groups``-th sample of a map-style dataset, from sample ``group`` on."""

    def __init__(self, dataset: Any, group: int, groups: int) -> None:
        self.dataset, self.group, self.groups = dataset, group, groups
        if len(dataset) < groups:
            raise UserError(f"plugins.torchft: the train split has {len(dataset)} samples, fewer than {groups} groups")
        if hasattr(dataset, "get_batch"):
            self.get_batch = self._get_batch

    def __len__(self) -> int:
        return (len(self.dataset) - self.group + self.groups - 1) // self.groups

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index * self.groups + self.group]

    def _get_batch(self, indices: torch.Tensor) -> Any:
        return self.dataset.get_batch(indices * self.groups + self.group)

    def __getattr__(self, name: str) -> Any:  # what else the dataset offers (seq_length, a tokenizer, ...)
        if name in ("dataset", "group", "groups"):
            raise AttributeError(name)
        return getattr(self.dataset, name)
