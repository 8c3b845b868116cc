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

A mixture-of-experts model (Mixtral, Qwen-MoE, ...) whose config sets ``output_router_logits``
trains with its load-balancing loss, as ``transformers`` adds it (``router_aux_loss_coef`` ×
its ``aux_loss``), and reports ``lm_loss``, ``moe_aux_loss`` and each layer's expert load
(``moe/layerN/load_min`` / ``load_max``: the smallest and largest share of the token
assignments an expert took), named as the ``gpt`` provider's experts are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from coretrain import UserError

IGNORE_INDEX = -100


class CausalLM(torch.nn.Module):
    """A ``*ForCausalLM`` model; ``model(input_ids, targets)`` or ``model(**hf_batch)`` is the loss."""

    def __init__(self, hf: torch.nn.Module, seq_length: int | None = None) -> None:
        super().__init__()
        self.hf: Any = hf  # a transformers PreTrainedModel
        self.seq_length = seq_length
        self.positions: torch.Tensor | None = None
        """Set by context parallelism: the positions of every sequence this rank computes (its
        attention, registered with transformers, sees every rank's keys and values)."""
        self.whole_sequence: Callable[[torch.Tensor], torch.Tensor] | None = None
        """Set by context parallelism: the logits of every rank's positions, in sequence order."""
        self.position_multiple = 1
        """Set by sequence parallelism: a dict batch's positions are padded to a multiple of it."""

    def forward(self, *args: torch.Tensor, **batch: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        if args:  # coretrain's (input_ids, targets): already shifted, every position a target
            input_ids, targets = args[0], (args[1] if len(args) > 1 else None)
            extra = {}
            if self.positions is not None:  # context parallelism: this rank's chunks, at their positions
                input_ids = input_ids[:, self.positions]
                targets = targets[:, self.positions] if targets is not None else None
                extra["position_ids"] = self.positions.expand(len(input_ids), -1)
            output = self.hf(input_ids=input_ids, use_cache=False, **extra)
            if targets is None:  # (input_ids) alone: the logits, as the gpt provider's model (a prediction)
                logits: torch.Tensor = output.logits
                return logits if self.whole_sequence is None else self.whole_sequence(logits)
            return with_experts(token_loss(output.logits, targets), output, self.hf.config, self.training)
        if self.positions is not None:
            raise UserError(
                "distributed.cp_size: context parallelism splits (input_ids, targets) windows, not dict batches"
            )
        batch = padded_to(batch, self.position_multiple, self.hf.config.pad_token_id)
        labels = batch.pop("labels", None)
        if labels is None:
            labels = batch["input_ids"]
            mask = batch.get("attention_mask")
            if mask is not None:
                labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
        # no cache in training: with none, position_ids that restart (packed examples) make
        # transformers mask attention per example
        output = self.hf(**batch, use_cache=False)
        targets = labels[:, 1:]  # the one shift: position t predicts t + 1
        loss = with_experts(token_loss(output.logits[:, :-1], targets), output, self.hf.config, self.training)
        # masked and padded batches differ in how many tokens count: say so, and the loop weighs
        # every token alike across micro-batches and ranks (coretrain.outputs.NUM_TOKENS)
        values = loss if isinstance(loss, dict) else {"loss": loss}
        return {**values, "num_tokens": (targets != IGNORE_INDEX).sum()}

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6·N (matmuls, embeddings excluded) + 12·L·H·T (attention)."""
        config = self.hf.config
        embeddings = sum(p.numel() for p in self.hf.get_input_embeddings().parameters())
        params = sum(p.numel() for p in self.hf.parameters()) - embeddings
        seq = self.seq_length if self.seq_length else int(getattr(config, "max_position_embeddings", 0))
        return float(6 * params + 12 * int(config.num_hidden_layers) * int(config.hidden_size) * seq)


LABEL_KEYS = ("labels", "label", "label_ids")
"""A sample's class, under the names transformers' data collators take it by (as the core's
``model.loss`` finds a dict batch's target)."""


class SequenceClassifier(torch.nn.Module):
    """A ``*ForSequenceClassification`` model; ``model(input_ids, labels)`` (or a dict) returns the
    loss (of a class, several, or a score: :meth:`scored`) and for a class the accuracy, both
    logged, and the logits (as transformers' model does: what ``coretrain predict`` writes and
    ``compute_metrics`` gets); a dict without labels, its logits."""

    per_position = False
    """Whether the model answers a class per position (a tagger) rather than per sequence."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf: Any = hf  # a transformers PreTrainedModel
        self.position_multiple = 1
        """Set by sequence parallelism: a batch's positions are padded to a multiple of it."""

    def forward(self, *args: torch.Tensor, **batch: torch.Tensor) -> dict[str, torch.Tensor]:
        labels: torch.Tensor | None
        if args:
            batch, labels = {"input_ids": args[0]}, (args[1] if len(args) > 1 else None)
        else:
            labels = next((batch.pop(key) for key in LABEL_KEYS if key in batch), None)
        length = batch["input_ids"].shape[1]
        logits = self.hf(**padded_to(batch, self.position_multiple, self.hf.config.pad_token_id)).logits
        if self.per_position:  # sequence parallelism's padding comes off: a class for each position given
            logits = logits[:, :length]
        if labels is None:
            return {"logits": logits}
        return self.scored(logits, labels)

    def scored(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """transformers' own loss for the config's ``problem_type``, guessed as the model guesses
        it when unset: one label of ``num_labels`` classes (cross-entropy, and the accuracy),
        several at once (float multi-hot labels: binary cross-entropy), or a score
        (``num_labels = 1``: mean squared error)."""
        from transformers.loss.loss_utils import ForSequenceClassificationLoss

        if self.hf.config.num_labels == 1:  # scores in a column of whole numbers are int64: torch 2.9's
            labels = labels.float()  # mse_loss backward refuses them ("Found dtype Long but expected Float")
        loss = ForSequenceClassificationLoss(labels, logits.float(), self.hf.config)
        values = {"loss": loss, "logits": logits}  # (logged: the single values)
        if self.hf.config.problem_type == "single_label_classification":
            values["accuracy"] = (logits.argmax(-1) == labels).float().mean()
        return values


class TokenClassifier(SequenceClassifier):
    """A ``*ForTokenClassification`` model (a tagger: named entities, parts of speech): a class
    per position, its labels aligned with ``input_ids`` and never shifted, -100 where none counts
    (as transformers' ``DataCollatorForTokenClassification`` pads them). Returns the loss over the
    labelled positions, their count (``num_tokens``: each labelled token weighs the same across
    micro-batches and ranks, however long the sentences) and the logits. No accuracy: a mean
    over micro-batches would weigh a short sentence's tokens more (``compute_metrics`` gives it).
    A masked LM's (``task = "masked-lm"``) is the same sum: a token per position, -100 but where
    the data's collate masked one."""

    per_position = True

    def scored(self, logits: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": token_loss(logits, labels), "num_tokens": (labels != IGNORE_INDEX).sum(), "logits": logits}


class Seq2SeqLM(torch.nn.Module):
    """An encoder-decoder (``AutoModelForSeq2SeqLM``: T5, BART; translation, summaries) on dict
    batches: ``input_ids`` and ``attention_mask`` the source's, ``labels`` the target's ids, -100
    where none counts (``DataCollatorForSeq2Seq``'s padding). The decoder reads the target
    shifted right (the model's own ``prepare_decoder_input_ids_from_labels``); the loss is the
    mean over the labelled tokens, returned with their count (``num_tokens``: each weighs the same
    across micro-batches and ranks) and the logits, one per target position."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf: Any = hf  # a transformers PreTrainedModel

    @property
    def config(self) -> Any:
        """The transformers config (``is_encoder_decoder``: a split's records keep the target's positions)."""
        return self.hf.config

    def forward(self, *args: torch.Tensor, **batch: torch.Tensor) -> dict[str, torch.Tensor]:
        labels = next((batch.pop(key) for key in LABEL_KEYS if key in batch), None)
        if args or labels is None:
            raise UserError(
                'model.options.task = "seq2seq-lm" takes dict batches of the source (input_ids, attention_mask) '
                "and the target's ids as labels, as DataCollatorForSeq2Seq makes them; this batch has "
                + ("a tuple" if args else "no labels")
            )
        decoder_input_ids = self.hf.prepare_decoder_input_ids_from_labels(labels=labels)
        logits = self.hf(**batch, decoder_input_ids=decoder_input_ids, use_cache=False).logits
        return {"loss": token_loss(logits, labels), "num_tokens": labels.ne(IGNORE_INDEX).sum(), "logits": logits}


def padded_to(batch: dict[str, torch.Tensor], multiple: int, pad_id: int | None) -> dict[str, torch.Tensor]:
    """``batch`` padded after its last position to a multiple of ``multiple`` (sequence parallelism
    splits the positions evenly over a tensor-parallel group; a padded batch is as long as its
    longest sample): ids with the pad id, the attention mask (made if absent) with 0, per-position
    labels with -100, position ids counting on. Nothing before the padding changes."""
    length = batch["input_ids"].shape[1]
    extra = -length % multiple
    if not extra:
        return batch
    fills = {"input_ids": pad_id or 0, "attention_mask": 0, "labels": IGNORE_INDEX, "token_type_ids": 0}
    padded = {"attention_mask": torch.ones_like(batch["input_ids"]), **batch}
    for key, value in padded.items():
        if key == "position_ids":
            padded[key] = torch.cat([value, value[:, -1:] + torch.arange(1, extra + 1, device=value.device)], dim=1)
        elif key in fills and value.dim() == 2 and value.shape[1] == length:
            padded[key] = F.pad(value, (0, extra), value=fills[key])
    return padded


def with_experts(
    loss: torch.Tensor, output: Any, config: Any, training: bool
) -> torch.Tensor | dict[str, torch.Tensor]:
    """``loss`` as it is, or for a mixture of experts that reports its routers (``output_router_logits``):
    a dict of the loss with the load-balancing loss added while training, the parts, and each
    layer's expert load."""
    aux, routers = getattr(output, "aux_loss", None), getattr(output, "router_logits", None)
    if aux is None or not routers:
        return loss
    aux = float(getattr(config, "router_aux_loss_coef", 0.0)) * aux.to(loss.device)
    values = {"loss": loss + aux if training else loss, "lm_loss": loss.detach(), "moe_aux_loss": aux.detach()}
    top_k = int(getattr(config, "num_experts_per_tok", 1))
    for i, logits in enumerate(routers):
        chosen = logits.detach().topk(top_k, dim=-1).indices.flatten()
        load = torch.bincount(chosen, minlength=logits.size(-1)).float() / chosen.numel()
        values |= {f"moe/layer{i}/load_min": load.min(), f"moe/layer{i}/load_max": load.max()}
    return values


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the target tokens that are not IGNORE_INDEX (in fp32)."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1).long(), ignore_index=IGNORE_INDEX
    )


def wrapped_model(module: torch.nn.Module) -> Any:
    """The Hugging Face model inside a wrapper (or the module itself)."""
    return getattr(module, "hf", module)


def adapted_model(model: Any) -> Any:
    """The transformers model itself: the one a PeftModel (LoRA) adapts, or ``model``."""
    return model.get_base_model() if hasattr(model, "peft_config") else model
