"""Model providers for runs that must go wrong on purpose (import paths for `coretrain run`)."""

from __future__ import annotations

import torch
from helpers_inprocess import Regression


class Faulty(Regression):
    """Returns a NaN or a spiked loss on chosen training steps (counted by forward calls)."""

    def __init__(self, nan_at: list[int], spike_at: list[int]) -> None:
        super().__init__()
        self.nan_at, self.spike_at, self.calls = set(nan_at), set(spike_at), 0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = super().forward(x, y)
        if not self.training:
            return loss
        self.calls += 1
        if self.calls in self.nan_at:
            return loss * float("nan")
        if self.calls in self.spike_at:
            return loss * 1e4 + 1e4
        return loss


def make_faulty(nan_at: list[int] = [], spike_at: list[int] = []) -> torch.nn.Module:  # noqa: B006 - read only
    return Faulty(nan_at, spike_at)
