"""``gpt``: a GPT model provider (nanoGPT-sized options).

    [model]
    provider = "gpt"
    [model.options]
    n_layer = 4
    n_head = 4
    n_embd = 128

``vocab_size`` and ``block_size`` default to the dataset's vocab size and sequence length.
"""

from __future__ import annotations

from typing import Any

from attrs import define, field

from coretrain import hookimpl


@define(kw_only=True)
class GPTProvider:
    """A readable GPT language model (pre-norm, tied embeddings, fused attention)."""

    n_layer: int = field(default=4)
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Model width."""
    vocab_size: int | None = None
    """Token vocabulary; unset = the dataset's vocab_size."""
    block_size: int | None = None
    """Longest sequence; unset = the dataset's seq_length."""
    dropout: float = 0.0
    """Dropout on attention, residual and embeddings."""
    bias: bool = False
    """Biases in Linear and LayerNorm layers (GPT-2 style)."""

    @hookimpl
    def provide_model(self, run: Any) -> Any:
        from coretrain.errors import UserError

        from coretrain_gpt.model import GPT, GPTConfig

        datasets = run.datasets
        vocab_size = self.vocab_size or (datasets.vocab_size if datasets else None)
        block_size = self.block_size or (datasets.seq_length if datasets else None)
        if not vocab_size or not block_size:
            raise UserError("model.options: the dataset does not say its vocab_size / seq_length; "
                            "set model.options.vocab_size and model.options.block_size")
        if self.n_embd % self.n_head:
            raise UserError(f"model.options.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        return GPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=self.n_layer,
                             n_head=self.n_head, n_embd=self.n_embd, dropout=self.dropout, bias=self.bias))
