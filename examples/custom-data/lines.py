"""Your own Dataset, a custom collate_fn and DataLoader workers: a character model of Python lines.

Samples are single lines of the standard library's source, so they differ in length; the
collate function pads each batch to its longest line and marks the padding with -100, which
cross_entropy ignores. Reading files is done by two DataLoader workers, off the training thread.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from coretrain import Datasets

MAX_LENGTH = 96


class Lines(torch.utils.data.Dataset):
    """Every line of 8..96 characters in the chosen files, as byte tensors, read lazily from disk."""

    def __init__(self, files: list[Path]) -> None:
        self.index = [
            (path, number)
            for path in files
            for number, line in enumerate(path.read_text(errors="replace").splitlines())
            if 8 <= len(line.encode()) <= MAX_LENGTH
        ]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> torch.Tensor:
        path, number = self.index[i]
        line = path.read_text(errors="replace").splitlines()[number]  # real file I/O per sample
        return torch.tensor(list(line.encode()), dtype=torch.long)


def pad(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The collate_fn: next-byte prediction, padded to the longest line of the batch."""
    length = max(len(s) for s in samples) - 1
    inputs = torch.zeros(len(samples), length, dtype=torch.long)
    labels = torch.full((len(samples), length), -100, dtype=torch.long)
    for row, sample in enumerate(samples):
        inputs[row, : len(sample) - 1] = sample[:-1]
        labels[row, : len(sample) - 1] = sample[1:]
    return {"tokens": inputs, "labels": labels}


def build_data(files: int = 40) -> Datasets:
    paths = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:files]
    return Datasets(train=Lines(paths[1:]), valid=Lines(paths[:1]))


class CharGRU(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, width)
        self.rnn = torch.nn.GRU(width, width, batch_first=True)
        self.head = torch.nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.rnn(self.embed(tokens))
        return self.head(hidden)  # [batch, time, 256] logits


def build_model(width: int = 64) -> torch.nn.Module:
    return CharGRU(width)
