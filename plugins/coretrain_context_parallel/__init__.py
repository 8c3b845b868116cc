"""``context-parallel``: each sequence of a batch split over ``distributed.cp_size`` ranks, for
sequences whose activations one rank cannot hold.

    [distributed]
    cp_size = 2     # data parallel = ranks / tp_size / cp_size

The ranks of a context-parallel group read the same batch; each computes 2 of the sequence's
2 × cp_size equal chunks, chunk r and chunk 2·cp_size − 1 − r, so that under the causal mask
every rank has the same amount of attention to compute (a plain split would give the last rank
all the long rows). Attention is over the whole sequence, each query seeing the keys at or
before its own position, by Megatron's ``cp_comm_type`` (:mod:`.exchanges`): every rank's keys
and values gathered (``all_gather``, the default), positions traded for heads (``a2a``), or
keys and values passed around a ring (``p2p``). Positions are the chunks' own. Each rank's loss is the mean over its
tokens, all ranks hold as many, and gradients are averaged over every data-parallel and
context-parallel rank, so the step's loss and gradients are those of the whole sequence.

torch's ``context_parallel`` (ring attention on SDPA) does not run on CPU: its CPU flash
attention has no sharding rule; these run on gloo and NCCL alike.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from attrs import define

from coretrain import Run, UserError, hookimpl
from coretrain_context_parallel.exchanges import EXCHANGES, GatheredAttention, balanced_positions

__all__ = ["ContextParallel", "GatheredAttention", "balanced_positions"]

log = logging.getLogger("coretrain")


class WholeSequence:
    """Every rank's outputs of its positions (batch × positions × ...), gathered over the ranks
    of the split and put in sequence order: what a prediction writes, as one rank has it."""

    def __init__(self, group: Any, ranks: int, positions: Any) -> None:
        import torch
        import torch.distributed as dist

        self.group, self.ranks = group, ranks
        everyone = [torch.empty_like(positions) for _ in range(ranks)]
        dist.all_gather(everyone, positions.contiguous(), group=group)
        self.order = torch.argsort(torch.cat(everyone))

    def __call__(self, local: Any) -> Any:
        import torch
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.ranks)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=1)[:, self.order.to(local.device)]


ATTENTION_NAME = "coretrain-context-parallel"


def use_in_transformers(hf: Any, attention: Any) -> None:
    """Make a transformers model attend through ``attention`` (transformers' own attention
    registry; the causal mask transformers builds for this rank's chunk alone is not used)."""
    from transformers import AttentionInterface

    def forward(module: Any, query: Any, key: Any, value: Any, mask: Any, dropout: float = 0.0, **kw: Any) -> Any:
        out = attention(query, key, value, dropout, kw.get("scaling"))
        return out.transpose(1, 2).contiguous(), None  # as transformers' sdpa returns it

    AttentionInterface.register(ATTENTION_NAME, forward)
    if hasattr(hf, "set_attn_implementation"):
        hf.set_attn_implementation(ATTENTION_NAME)
    else:
        hf.config._attn_implementation = ATTENTION_NAME


def check_chunks(cp: int, tp: int, seq: int | None) -> int:
    """``seq``, checked: each sequence cuts into 2 × cp equal chunks, and a rank's positions over
    tensor parallelism."""
    if not seq or seq % (2 * cp):
        raise UserError(
            f"distributed.cp_size ({cp}) must cut the sequence length ({seq}) into 2 × cp_size equal chunks"
        )
    if (seq // cp) % tp:  # tensor parallelism splits a rank's positions again
        raise UserError(f"distributed.tp_size ({tp}) must divide each rank's {seq // cp} positions")
    return seq


@define(kw_only=True)
class ContextParallel:
    """Split each sequence over the context-parallel ranks; attention over all of it."""

    cp_comm_type: Literal["all_gather", "a2a", "p2p"] = "all_gather"
    """Megatron's: how the ranks attend over the whole sequence (:mod:`.exchanges`): gather every
    rank's keys and values, trade positions for heads (all-to-all: the heads must divide over
    the ranks), or pass keys and values around a ring (p2p: without attention dropout)."""

    @hookimpl
    def check_layout(self, config: Any) -> None:
        """The sequence length, when the data provider's options give it (``seq_length``, as
        coretrain's text providers name it), cuts into the chunks (said once for a job)."""
        seq = config.data.options.get("seq_length")
        if isinstance(seq, int) and config.distributed.cp_size > 1:
            check_chunks(config.distributed.cp_size, config.distributed.tp_size, seq)

    @hookimpl(tryfirst=True)  # on the model as built, before data parallelism wraps it
    def configure_model(self, run: Run) -> None:
        cp, seq = run.config.distributed.cp_size, run.datasets.seq_length
        model: Any = run.model
        attentions = [m for m in model.modules() if hasattr(m, "exchange")]
        hf = getattr(model, "hf", None)  # the hf provider's causal LM: its attention is registered with transformers
        if not hasattr(model, "positions") or not (attentions or hf is not None):
            raise UserError(
                f"distributed.cp_size ({cp}): this model cannot split its sequences (the gpt and hf providers' can)"
            )
        seq = check_chunks(cp, run.dist.tp_size, seq)
        mesh = run.device_mesh()["cp"]
        rank = mesh.get_local_rank()
        attention = EXCHANGES[self.cp_comm_type](mesh.get_group(), cp, rank, seq, run.device)
        model.positions = attention.queries
        if hasattr(model, "whole_sequence"):  # its outputs without targets (a prediction): every position
            model.whole_sequence = WholeSequence(mesh.get_group(), cp, attention.queries)
        for module in attentions:
            module.exchange = attention
        if hf is not None:
            use_in_transformers(hf, attention)
        if run.dist.is_main:
            log.info(
                "context-parallel: each sequence of %d positions over %d ranks, %d positions each (%s)",
                *(seq, cp, len(attention.queries), self.cp_comm_type),
            )
