"""How the context-parallel ranks attend over the whole sequence: Megatron's ``cp_comm_type``.

Each rank holds the queries, keys and values of its positions (two of the sequence's 2 × cp
chunks, :func:`balanced_positions`); a query sees the keys at or before its own position.

- ``all_gather``: every rank's keys and values gathered, this rank's queries over all of them
  (the whole sequence's keys and values on every rank, kept for backward);
- ``a2a`` (Megatron's, DeepSpeed-Ulysses): an all-to-all trades positions for heads, so each rank
  holds every position of ``heads / cp`` heads, attends over the whole sequence for them, and a
  second all-to-all trades back (the heads must divide over the ranks);
- ``p2p`` (ring attention): the keys and values pass from rank to rank around the ring, one
  rank's chunk at a time, merged into this rank's output with their log-sum-exp (the softmax
  of the whole row, never formed); backward passes them round again with their gradients,
  so no rank ever holds more than its own and one other's.

The three give the same attention (``tests/test_context_parallel.py``: one rank's losses); the
activation memory per rank of each is in ``benchmarks/context_memory.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


def balanced_positions(seq_length: int, ranks: int, rank: int) -> torch.Tensor:
    """The positions rank ``rank`` computes: chunks ``rank`` and ``2·ranks − 1 − rank`` of the
    sequence cut into ``2·ranks`` equal chunks (load-balanced under a causal mask)."""
    chunks = torch.arange(seq_length).chunk(2 * ranks)
    return torch.cat([chunks[rank], chunks[2 * ranks - 1 - rank]])


def _full_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention's keys and values repeated to one head per query head."""
    groups = q.size(1) // k.size(1)
    return (k, v) if groups == 1 else (k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1))


class SplitSequence:
    """What every exchange knows: the context-parallel group, and the positions this rank holds
    (the model reads them as ``model.positions``)."""

    def __init__(self, group: Any, ranks: int, rank: int, seq_length: int, device: Any) -> None:
        self.group, self.ranks, self.rank = group, ranks, rank
        self.queries = balanced_positions(seq_length, ranks, rank).to(device)
        self.everyones = torch.cat([balanced_positions(seq_length, ranks, r) for r in range(ranks)]).to(device)
        """Every rank's positions, in rank order: how gathered or exchanged parts line up."""


class GatheredAttention(SplitSequence):
    """``all_gather``: this rank's queries over every rank's keys and values."""

    def __init__(self, group: Any, ranks: int, rank: int, seq_length: int, device: Any) -> None:
        super().__init__(group, ranks, rank, seq_length, device)
        self.mask = self.everyones[None, :] <= self.queries[:, None]  # a query sees the keys at or before it

    def __call__(self, q: Any, k: Any, v: Any, dropout_p: float, scale: float | None = None) -> Any:
        keys, values = _full_heads(q, gathered(k, self.group, self.ranks), gathered(v, self.group, self.ranks))
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.mask, dropout_p=dropout_p, scale=scale)


def gathered(local: Any, group: Any, ranks: int) -> Any:
    """Every rank's ``local`` (batch × heads × positions × dims) along the positions, in rank
    order; in backward each rank gets the gradient of its own part summed over every rank's use."""
    return gather_function().apply(local, group, ranks)


@functools.cache
def gather_function() -> Any:
    """The differentiable all-gather."""

    class Gather(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, part: Any, group: Any, ranks: int) -> Any:
            ctx.group, ctx.ranks = group, ranks
            parts = [torch.empty_like(part) for _ in range(ranks)]
            dist.all_gather(parts, part.contiguous(), group=group)
            return torch.cat(parts, dim=2)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            total = grad.contiguous()
            dist.all_reduce(total, group=ctx.group)  # every rank's queries' use of every part
            return total.chunk(ctx.ranks, dim=2)[dist.get_rank(ctx.group)], None, None

    return Gather


class AllToAllAttention(SplitSequence):
    """``a2a``: positions traded for heads, attention over the whole sequence for ``heads / cp``
    of them, traded back (torch's differentiable all-to-all)."""

    def __init__(self, group: Any, ranks: int, rank: int, seq_length: int, device: Any) -> None:
        super().__init__(group, ranks, rank, seq_length, device)
        self.mask = self.everyones[None, :] <= self.everyones[:, None]  # every position against every position

    def _exchange(self, x: torch.Tensor, split: int, join: int) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all

        parts = [part.contiguous() for part in x.chunk(self.ranks, dim=split)]
        received = all_to_all([torch.empty_like(part) for part in parts], parts, group=self.group)  # type: ignore[no-untyped-call]
        return torch.cat(received, dim=join)

    def __call__(self, q: Any, k: Any, v: Any, dropout_p: float, scale: float | None = None) -> Any:
        if q.size(1) % self.ranks:
            from coretrain import UserError

            raise UserError(
                f'plugins.context-parallel.cp_comm_type = "a2a" splits the {q.size(1)} attention heads a rank holds '
                f'over distributed.cp_size ({self.ranks}) ranks: they must divide; use "all_gather" or "p2p"'
            )
        k, v = _full_heads(q, k, v)
        q, k, v = (self._exchange(x, split=1, join=2) for x in (q, k, v))  # heads / cp, every position
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, dropout_p=dropout_p, scale=scale)
        return self._exchange(out, split=2, join=1)  # every head, this rank's positions


class RingAttention(SplitSequence):
    """``p2p``: each rank's keys and values passed around the ring, merged by log-sum-exp."""

    def __init__(self, group: Any, ranks: int, rank: int, seq_length: int, device: Any) -> None:
        super().__init__(group, ranks, rank, seq_length, device)
        chunks = self.everyones.chunk(ranks)  # rank r's positions
        # the mask of the chunk this rank holds at each ring step: at step s, rank (rank - s)'s
        self.masks = [chunks[(rank - s) % ranks][None, :] <= self.queries[:, None] for s in range(ranks)]

    def __call__(self, q: Any, k: Any, v: Any, dropout_p: float, scale: float | None = None) -> Any:
        if dropout_p:
            from coretrain import UserError

            raise UserError(
                'plugins.context-parallel.cp_comm_type = "p2p": attention dropout is not supported (the '
                'softmax of a row is never formed whole); set the model\'s dropout to 0 or use "all_gather"'
            )
        k, v = _full_heads(q, k, v)
        scale = scale if scale is not None else q.size(-1) ** -0.5
        return ring_function().apply(q, k, v, self, scale)

    def pass_on(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Send ``tensors`` to the next rank of the ring, receive the previous rank's."""
        ranks = dist.get_process_group_ranks(self.group)
        after, before = ranks[(self.rank + 1) % self.ranks], ranks[(self.rank - 1) % self.ranks]
        received = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), after, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, before, self.group) for r in received]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return received


def _block(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked attention scores of this rank's queries against one chunk's keys (fp32)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return scores.masked_fill(~mask, float("-inf"))


@functools.cache
def ring_function() -> Any:
    """Ring attention with its own backward: only this rank's inputs, output and log-sum-exp
    are kept; backward recomputes each chunk's scores as the chunks come round again."""

    class Ring(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, q: Any, k: Any, v: Any, ring: RingAttention, scale: float) -> Any:
            out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            lse = torch.full(q.shape[:-1], float("-inf"), device=q.device)
            chunk_k, chunk_v = k, v
            for step in range(ring.ranks):
                scores = _block(q, chunk_k, ring.masks[step], scale)
                block_lse = torch.logsumexp(scores, dim=-1)
                merged = torch.logaddexp(lse, block_lse)
                weights = torch.exp(scores - merged[..., None]).nan_to_num(0.0)  # rows seeing none of it: 0
                out = out * torch.exp(lse - merged).nan_to_num(0.0)[..., None] + torch.matmul(weights, chunk_v.float())
                lse = merged
                if step < ring.ranks - 1:
                    chunk_k, chunk_v = ring.pass_on(chunk_k, chunk_v)
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.ring, ctx.scale = ring, scale
            return out.to(q.dtype)

        @staticmethod
        def backward(ctx: Any, grad_out: Any) -> Any:
            q, k, v, out, lse = ctx.saved_tensors
            ring, scale = ctx.ring, ctx.scale
            grad_out = grad_out.float()
            delta = (grad_out * out).sum(dim=-1, keepdim=True)
            grad_q = torch.zeros_like(q, dtype=torch.float32)
            chunk_k, chunk_v = k, v
            grad_k, grad_v = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
            for step in range(ring.ranks):
                probs = torch.exp(_block(q, chunk_k, ring.masks[step], scale) - lse[..., None]).nan_to_num(0.0)
                grad_v = grad_v + torch.matmul(probs.transpose(-1, -2), grad_out)
                grad_scores = probs * (torch.matmul(grad_out, chunk_v.float().transpose(-1, -2)) - delta)
                grad_q = grad_q + torch.matmul(grad_scores, chunk_k.float()) * scale
                grad_k = grad_k + torch.matmul(grad_scores.transpose(-1, -2), q.float()) * scale
                # the chunk and the gradients it gathered so far go on; after a full round each is home
                chunk_k, chunk_v, grad_k, grad_v = ring.pass_on(chunk_k, chunk_v, grad_k, grad_v)
            return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None

    return Ring


EXCHANGES = {"all_gather": GatheredAttention, "a2a": AllToAllAttention, "p2p": RingAttention}
"""``cp_comm_type`` -> how the ranks attend over the whole sequence."""
