"""``mock``: random tokens, no files (Megatron's MockGPTDataset): benchmarks and smoke tests of
a model and a layout before the data exists."""

from __future__ import annotations

import torch
from attrs import define, field

from coretrain import DatasetContext, Datasets, Run, hookimpl, positive


class MockTokens:
    """``samples`` (input, target) windows of uniform random ids, fixed by (seed, index)."""

    def __init__(self, samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        self.samples, self.seq_length, self.vocab_size, self.seed = samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.samples:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        window = torch.randint(self.vocab_size, (self.seq_length + 1,), generator=generator)
        return window[:-1], window[1:]


@define(kw_only=True)
class Mock:
    """Random tokens for benchmarks and smoke tests (Megatron's mock data): no files needed."""

    seq_length: int = field(default=1024, validator=positive)
    """Tokens per sample."""
    vocab_size: int = field(default=50304, validator=positive)
    """Token ids are drawn below this (and passed on to the model)."""

    @hookimpl
    def provide_datasets(self, run: Run, context: DatasetContext) -> Datasets:
        valid = MockTokens(max(context.valid_samples, 1), self.seq_length, self.vocab_size, context.seed + 1)
        return Datasets(
            train=MockTokens(max(context.train_samples, 1), self.seq_length, self.vocab_size, context.seed),
            valid=valid,
            seq_length=self.seq_length,
            vocab_size=self.vocab_size,
        )
