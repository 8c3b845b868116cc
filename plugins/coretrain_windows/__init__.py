"""Language-model datasets over one 1-D token tensor: fixed windows (:class:`TokenWindows`) or
windows at seeded random offsets (:class:`RandomWindows`), each sample an (input, next-token
target) pair with a ``get_batch`` fast path.

A library of coretrain-plugins for data providers — its ``text-bytes``, ``token-file`` and
``hf-text`` and yours (``from coretrain_windows import TokenWindows``). Until 0.3.0 these were
the core's ``coretrain.TokenWindows``, ``coretrain.RandomWindows`` and ``coretrain.windows``;
those names still resolve here, with a deprecation warning.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TokenWindows", "RandomWindows", "windows", "shifted"]


SIGNED_VIEWS = {torch.uint16: (torch.int16, 0xFFFF), torch.uint32: (torch.int32, 0xFFFF_FFFF)}
"""Unsigned token ids (nanoGPT's uint16 ``train.bin``) gathered through a signed view of the same
bytes, then masked back: torch 2.9 cannot index unsigned tensors on the CPU ("index_cpu" not
implemented for 'UInt16')."""


def gathered(tokens: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tokens[index]`` as int64 ids, whatever the tokens' integer type."""
    if tokens.dtype not in SIGNED_VIEWS:
        return tokens[index].long()
    signed, mask = SIGNED_VIEWS[tokens.dtype]
    return tokens.view(signed)[index].long() & mask


def shifted(windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of a batch of ``seq_length + 1`` windows, each its own contiguous tensor, as
    Megatron's GPTDataset returns them: slices of one tensor are not, and a model's
    ``targets.view(-1)`` (nanoGPT's loss) fails on them."""
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


class TokenWindows:
    """Non-overlapping (input, target) windows of ``seq_length`` over a 1-D token tensor.

    Sample i is tokens[i·T : i·T + T + 1] split into input and next-token target, as nanoGPT
    and Megatron's GPT datasets do. Works on memory-mapped tensors: only the windows a batch
    needs are read. ``get_batch`` gathers a whole micro-batch with one indexing op.
    """

    def __init__(self, tokens: torch.Tensor, seq_length: int) -> None:
        if tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor")
        self.tokens, self.seq_length = tokens, seq_length
        self._offsets = torch.arange(seq_length + 1)

    def __len__(self) -> int:
        return max((self.tokens.numel() - 1) // self.seq_length, 0)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_length
        window = self.tokens[start : start + self.seq_length + 1].long()
        return window[:-1], window[1:]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = gathered(self.tokens, (indices * self.seq_length).unsqueeze(1) + self._offsets)
        return shifted(windows)


def _mix(values: torch.Tensor) -> torch.Tensor:
    """A stateless 64-bit integer hash (splitmix64's finalizer; int64 arithmetic wraps)."""
    x = values * -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
    x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & 0x1FFFFFFFF)


class RandomWindows:
    """``count`` (input, target) windows at random offsets, as nanoGPT samples its batches.

    Window i starts at a seeded hash of i, so the windows are fixed by (seed, index): the
    sample order and resume treat them like any map-style dataset, and a run built for
    ``count`` = the samples it will consume sees a fresh random offset for every sample.
    """

    def __init__(self, tokens: torch.Tensor, seq_length: int, count: int, seed: int) -> None:
        if tokens.dim() != 1:
            raise ValueError("tokens must be a 1-D tensor")
        self.tokens, self.seq_length, self.count = tokens, seq_length, count
        self.span = tokens.numel() - seq_length  # offsets 0 .. span-1 leave room for the target
        self.salt = (seed + 1) * 1_000_003
        self._offsets = torch.arange(seq_length + 1)

    def __len__(self) -> int:
        return self.count if self.span > 0 else 0

    def starts(self, indices: torch.Tensor) -> torch.Tensor:
        return torch.remainder(_mix(indices.long() + self.salt), self.span)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = int(self.starts(torch.tensor([index]))[0])
        window = self.tokens[start : start + self.seq_length + 1].long()
        return window[:-1], window[1:]

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        windows = gathered(self.tokens, self.starts(indices).unsqueeze(1) + self._offsets)
        return shifted(windows)


def windows(tokens: torch.Tensor, seq_length: int, sampling: str, count: int, seed: int) -> Any:
    """Fixed, non-overlapping windows, or ``count`` windows at random offsets ("random")."""
    if sampling == "random":
        return RandomWindows(tokens, seq_length, max(count, (tokens.numel() - 1) // seq_length), seed)
    return TokenWindows(tokens, seq_length)
