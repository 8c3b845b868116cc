"""Hugging Face models on coretrain's batches, with the labels shifted exactly once.

Two batch conventions meet here, and mixing them up silently trains the wrong objective:

- coretrain's text providers (``token-file``, ``text-bytes``, ``hf-text``) yield
  ``(input_ids, targets)`` where ``targets[t]`` is already the token after ``input_ids[t]``;
  the loss is cross-entropy of the logits at t against ``targets[t]``, no shift.
- Hugging Face batches are dicts whose ``labels`` are aligned with ``input_ids`` (a copy, with
  -100 where no loss is taken); the loss compares the logits at t with ``labels[t + 1]``.

:class:`CausalLM` takes either and computes the loss itself (the model is called without
``labels``), so neither convention is shifted twice. The loss is the mean over the tokens that
count (labels != -100); for dict batches the model also returns ``num_tokens``, so the loop
averages over every real token of the step, not over micro-batches (Megatron's per-token loss).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


class CausalLM(torch.nn.Module):
    """A ``*ForCausalLM`` model; ``model(input_ids, targets)`` or ``model(**hf_batch)`` is the loss."""

    def __init__(self, hf: torch.nn.Module, seq_length: int | None = None) -> None:
        super().__init__()
        self.hf: Any = hf  # a transformers PreTrainedModel
        self.seq_length = seq_length

    def forward(self, *args: torch.Tensor, **batch: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        if args:  # coretrain's (input_ids, targets): already shifted, every position a target
            input_ids, targets = args
            logits = self.hf(input_ids=input_ids, use_cache=False).logits
            return token_loss(logits, targets)
        labels = batch.pop("labels", None)
        if labels is None:
            labels = batch["input_ids"]
            mask = batch.get("attention_mask")
            if mask is not None:
                labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
        # no cache in training: with none, position_ids that restart (packed examples) make
        # transformers mask attention per example
        logits = self.hf(**batch, use_cache=False).logits
        targets = labels[:, 1:]  # the one shift: position t predicts t + 1
        # masked and padded batches differ in how many tokens count: say so, and the loop weighs
        # every token alike across micro-batches and ranks (coretrain.outputs.NUM_TOKENS)
        return {"loss": token_loss(logits[:, :-1], targets), "num_tokens": (targets != IGNORE_INDEX).sum()}

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6·N (matmuls, embeddings excluded) + 12·L·H·T (attention)."""
        config = self.hf.config
        embeddings = sum(p.numel() for p in self.hf.get_input_embeddings().parameters())
        params = sum(p.numel() for p in self.hf.parameters()) - embeddings
        seq = self.seq_length if self.seq_length else int(getattr(config, "max_position_embeddings", 0))
        return float(6 * params + 12 * int(config.num_hidden_layers) * int(config.hidden_size) * seq)


class SequenceClassifier(torch.nn.Module):
    """A ``*ForSequenceClassification`` model; ``model(input_ids, labels)`` (or a dict) returns the
    cross-entropy loss and the accuracy, both logged."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf: Any = hf  # a transformers PreTrainedModel

    def forward(self, *args: torch.Tensor, **batch: torch.Tensor) -> dict[str, torch.Tensor]:
        if args:
            input_ids, labels = args
            batch = {"input_ids": input_ids}
        else:
            labels = batch.pop("labels")
        logits = self.hf(**batch).logits
        loss = F.cross_entropy(logits.float(), labels.long())
        accuracy = (logits.argmax(-1) == labels).float().mean()
        return {"loss": loss, "accuracy": accuracy}


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the target tokens that are not IGNORE_INDEX (in fp32)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1).long(), ignore_index=IGNORE_INDEX
    )


def wrapped_model(module: torch.nn.Module) -> Any:
    """The Hugging Face model inside a wrapper (or the module itself)."""
    return getattr(module, "hf", module)
