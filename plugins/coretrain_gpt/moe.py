"""Mixture of experts for the GPT: Megatron-Core's top-k router, its auxiliary losses and
expert capacity, in plain PyTorch.

Routing, as Megatron-Core's ``TopKRouter`` with its defaults (softmax score function,
``moe_router_pre_softmax = false``): each token's router logits (computed in fp32) pick its
``top_k`` experts, and the softmax over those ``top_k`` logits weighs their outputs.

- Load balancing (``moe_aux_loss_coeff``, Megatron's ``switch_load_balancing_loss_func`` at the
  micro-batch level): ``E · Σ_i f_i · P_i · coeff``, with ``f_i`` the share of the micro-batch's
  token assignments that chose expert ``i`` and ``P_i`` the mean full-softmax probability of it;
  1 × coeff when the load is even.
- Router z-loss (``moe_z_loss_coeff``, ST-MoE): ``mean(logsumexp(logits)²) · coeff``.
- Capacity (``moe_capacity_factor``; unset: dropless): each expert takes at most
  ``ceil(tokens · top_k / E · factor)`` assignments, the most probable ones (Megatron's
  ``drop_policy = "probs"``); a dropped assignment adds nothing, so the token keeps its residual.
- Shared experts (``moe_shared_experts``): a dense MLP of that many experts' width that every
  token passes through, added to the routed output (DeepSeek's shared experts).

The experts' weights are stacked, one tensor per projection with the expert first
(``experts.fc.weight``: experts × hidden × width), as grouped GEMMs and torchtitan keep them:
spreading experts over ranks is then a split of that first dimension, and a checkpoint
names the same tensors however the experts are spread.

Both losses are added to the training loss (what is optimized); :attr:`MoE.stats` holds the
layer's losses and its expert load (the smallest and largest share of assignments) for logging.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from attrs import define


@define(frozen=True)
class MoEConfig:
    n_experts: int
    top_k: int
    capacity_factor: float | None
    aux_loss_coeff: float
    z_loss_coeff: float
    shared_experts: int


def load_balancing_loss(probs: torch.Tensor, routed: torch.Tensor, top_k: int, coeff: float) -> torch.Tensor:
    """Megatron's switch load-balancing loss: ``probs`` the full softmax (tokens × experts),
    ``routed`` the top-k choice before any capacity drop (tokens × experts, bool)."""
    tokens, experts = probs.shape
    per_expert = routed.sum(dim=0).to(probs.dtype)
    return (probs.sum(dim=0) * per_expert).sum() * (experts * coeff / (top_k * tokens * tokens))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: keeps the router's logits small."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


def capacity(tokens: int, cfg: MoEConfig) -> int:
    """Assignments one expert takes at most (Megatron's ``get_capacity``)."""
    assert cfg.capacity_factor is not None
    return math.ceil(tokens * cfg.top_k / cfg.n_experts * cfg.capacity_factor)


def drop_over_capacity(weights: torch.Tensor, routed: torch.Tensor, limit: int) -> torch.Tensor:
    """The routing map with each expert's assignments beyond ``limit`` dropped, the least
    probable first."""
    if limit >= weights.size(0):
        return routed
    kept = torch.zeros_like(routed).scatter(0, torch.topk(weights, k=limit, dim=0, sorted=False).indices, True)
    return routed & kept


class StackedLinear(nn.Module):
    """One ``nn.Linear`` per expert, stacked: ``weight`` is experts × out × in."""

    def __init__(self, experts: int, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features).normal_(0.0, 0.02))
        self.bias = nn.Parameter(torch.zeros(experts, out_features)) if bias else None

    def forward(self, x: torch.Tensor, expert: int, bias: bool = True) -> torch.Tensor:
        """Expert ``expert`` of the ones this rank holds (all of them, unless expert parallelism
        spread them: then ``weight`` is a DTensor and this rank's slice is used)."""
        added = None if self.bias is None or not bias else local(self.bias)[expert]
        return F.linear(x, local(self.weight)[expert], added)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor parameter (differentiably), or the tensor itself."""
    part: torch.Tensor = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return part


class Experts(nn.Module):
    """The routed experts: each the GPT's MLP (GELU, 4× wide), their weights stacked."""

    TENSOR_SPLIT = {"fc.weight": 1, "fc.bias": 1, "proj.weight": 2, "proj.bias": None}
    """The dimension of each parameter that expert tensor parallelism splits (None: whole on
    every rank): each rank holds a share of every expert's hidden units, as Megatron's."""

    def __init__(self, experts: int, n_embd: int, bias: bool, dropout: float) -> None:
        super().__init__()
        self.fc = StackedLinear(experts, n_embd, 4 * n_embd, bias)
        self.proj = StackedLinear(experts, 4 * n_embd, n_embd, bias)
        self.dropout = nn.Dropout(dropout)
        self.n_experts = experts
        self.tensor_split: TensorSplit | None = None
        """Set by tensor parallelism: the ranks holding a share of each expert's hidden units,
        which see the same tokens and sum their partial outputs."""
        self.dispatch: Callable[[Experts, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        """Set by expert parallelism: sends each token to its experts' rank and back
        (``dispatch(experts, tokens, kept, weights)`` → the weighted sum of its experts' outputs,
        computed there by :meth:`expert_rows`)."""

    def expert_rows(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """What expert parallelism calls on the rows that arrived: :meth:`forward`."""
        out: torch.Tensor = self(rows, expert)
        return out

    def forward(self, rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        """Each row (a token, width wide) through its expert (``expert``: the index of one this
        rank holds, per row). An expert no row chose still runs, on none: every parameter gets a
        gradient, as DDP and FSDP expect."""
        split = self.tensor_split
        rows = split.entering(rows) if split else rows
        out = rows.new_zeros(len(rows), self.proj.weight.size(1))
        for e in range(local(self.fc.weight).size(0)):
            which = (expert == e).nonzero().squeeze(1)
            hidden = F.gelu(self.fc(rows[which], e))
            out = out.index_add(0, which, self.proj(hidden, e, bias=split is None))
        if split is not None:
            out = split.summed(out)
            if self.proj.bias is not None:  # once, after the ranks' shares are summed
                out = out + local(self.proj.bias)[expert]
        dropped: torch.Tensor = self.dropout(out)
        return dropped


class TensorSplit:
    """The ranks that each hold a share of every expert's hidden units (the tensor-parallel
    group). They compute the same rows: their shares of the outputs are summed in forward, their
    shares of the inputs' gradients in backward (Megatron's ``copy_to`` / ``reduce_from``
    tensor-parallel region)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def entering(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` as they are; in backward, their gradient summed over the group."""
        out: torch.Tensor = _reduce_function().apply(rows, self.group, False)
        return out

    def summed(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` summed over the group; in backward, the gradient as it is."""
        out: torch.Tensor = _reduce_function().apply(rows, self.group, True)
        return out


@functools.cache
def _reduce_function() -> Any:
    """An all-reduce in forward (``forward_sum``) or in backward, defined once."""
    import torch.distributed as dist

    class Reduce(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, rows: torch.Tensor, group: Any, forward_sum: bool) -> torch.Tensor:
            ctx.group, ctx.forward_sum = group, forward_sum
            if not forward_sum:
                return rows.view_as(rows)
            total = rows.clone()
            dist.all_reduce(total, group=group)
            return total

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            if ctx.forward_sum:
                return grad, None, None
            total = grad.clone()
            dist.all_reduce(total, group=ctx.group)
            return total, None, None

    return Reduce


class MoE(nn.Module):
    """Routed experts (and optional shared ones) in place of a block's MLP."""

    def __init__(self, n_embd: int, bias: bool, dropout: float, cfg: MoEConfig, shared: nn.Module | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(n_embd, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, n_embd, bias, dropout)
        self.shared = shared
        self.stats: dict[str, torch.Tensor] = {}
        """The last forward's ``aux_loss``, ``z_loss``, ``load_min`` and ``load_max``."""
        self.losses_in_backward = False
        """Set by a pipeline stage: the routers' losses join what backward optimizes through
        this layer's output (:func:`with_router_losses`), not through the model's returned loss
        (computed on another stage)."""
        self.batch = 1
        """The sequences of the last forward's input (its tokens are batch × positions)."""
        self.sequence_split: SequenceSplit | None = None
        """Set when each sequence is split over ranks (context parallelism): the routing
        statistics — token counts, the capacity's choice, the load-balancing loss, the load —
        are the whole sequences', as one rank computes them."""
        self.history: list[dict[str, torch.Tensor]] | None = None
        """Set to a list by a pipeline stage: each forward's stats, detached, kept for the
        step's logged values (a stage runs several micro-batches before anything is logged)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        tokens = x.reshape(-1, x.size(-1))
        self.batch = len(x) if x.dim() > 2 else 1
        logits = F.linear(tokens.float(), local(self.router.weight).float())  # the router in fp32, as Megatron's
        top_logits, chosen = logits.topk(cfg.top_k, dim=-1)
        routed = torch.zeros_like(logits, dtype=torch.bool).scatter(1, chosen, True)
        weights = torch.zeros_like(logits).scatter(1, chosen, torch.softmax(top_logits, dim=-1))
        split = self.sequence_split
        kept = routed if cfg.capacity_factor is None else self._within_capacity(weights, routed)
        dispatch = self.experts.dispatch or combine
        out = dispatch(self.experts, tokens, kept, weights)
        if self.shared is not None:
            out = out + self.shared(tokens)
        counted = kept.sum(dim=0).float()
        load = (split.summed(counted) if split else counted) / (self._tokens(len(tokens)) * cfg.top_k)
        self.stats = {
            "aux_loss": self._aux_loss(torch.softmax(logits, dim=-1), routed),
            "z_loss": z_loss(logits, cfg.z_loss_coeff),  # a mean over tokens: each rank's share holds as many
            "load_min": load.min().detach(),
            "load_max": load.max().detach(),
        }
        if self.history is not None:
            self.history.append({name: value.detach() for name, value in self.stats.items()})
        if self.losses_in_backward and self.training:
            out = with_router_losses(out, self.stats["aux_loss"] + self.stats["z_loss"])
        return out.view_as(x)

    def _tokens(self, here: int) -> int:
        """Tokens of the whole sequences (every rank of a split holds an equal share)."""
        return here * (self.sequence_split.ranks if self.sequence_split else 1)

    def _within_capacity(self, weights: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The assignments each expert keeps, chosen over the whole sequences' tokens."""
        split, cfg = self.sequence_split, self.cfg
        limit = capacity(self._tokens(len(weights)), cfg)
        if split is None:
            return drop_over_capacity(weights, routed, limit)
        batch = self.batch  # (the order decides equal weights: the whole sequences', as one rank has them)
        all_weights = split.in_sequence_order(split.gathered(weights), batch)
        all_routed = split.in_sequence_order(split.gathered(routed), batch)
        return split.this_ranks(drop_over_capacity(all_weights, all_routed, limit), batch)

    def _aux_loss(self, probs: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss of the whole sequences: its counts summed over the ranks of a
        split, this rank's probabilities, scaled so that the ranks' mean (what their gradients
        and logged values average to) is the whole loss (Megatron-Core's reduction over TP × CP)."""
        split, cfg = self.sequence_split, self.cfg
        per_expert = routed.sum(dim=0).to(probs.dtype)
        if split is None:
            return load_balancing_loss(probs, routed, cfg.top_k, cfg.aux_loss_coeff)
        tokens, experts = self._tokens(len(probs)), probs.size(1)
        share = (probs.sum(dim=0) * split.summed(per_expert)).sum() * (experts * cfg.aux_loss_coeff)
        return share / (cfg.top_k * tokens * tokens) * split.ranks


def combine(experts: Experts, tokens: torch.Tensor, kept: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's experts' outputs, weighted and summed (in the order of the experts, as
    expert parallelism sums them), with every expert here."""
    token_idx, expert_idx = assignments(kept)
    computed = experts(tokens[token_idx], expert_idx)
    scaled = computed * weights[token_idx, expert_idx, None].to(tokens.dtype)
    return torch.zeros_like(tokens).index_add(0, token_idx, scaled)


def assignments(kept: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept (token, expert) pairs of a routing map, by expert, each expert's tokens in order."""
    token_idx, expert_idx = kept.nonzero(as_tuple=True)  # by token, then expert
    order = torch.argsort(expert_idx, stable=True)
    return token_idx[order], expert_idx[order]


def moe_outputs(loss: torch.Tensor, layers: list[MoE], training: bool) -> dict[str, torch.Tensor]:
    """The model's returned dict: the loss (with the routers' losses while training), the
    language-model loss alone, and each MoE layer's losses and expert load."""
    stats = [layer.stats for layer in layers]
    aux = torch.stack([s["aux_loss"] for s in stats]).sum()
    zed = torch.stack([s["z_loss"] for s in stats]).sum()
    values: dict[str, torch.Tensor] = {
        "loss": loss + aux + zed if training else loss,
        "lm_loss": loss.detach(),
        "moe_aux_loss": aux.detach(),
        "moe_z_loss": zed.detach(),
    }
    for i, s in enumerate(stats):
        values.update({f"moe/layer{i}/{name}": value.detach() for name, value in s.items()})
    return values


class SequenceSplit:
    """The ranks that split each sequence of a batch, each holding an equal share of its tokens
    (``positions``: this rank's positions in the sequence, when known)."""

    def __init__(self, group: Any, positions: torch.Tensor | None = None) -> None:
        import torch.distributed as dist

        self.group, self.ranks, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.order: torch.Tensor | None = None
        """Where each position of the whole sequence is among every rank's, rank after rank."""
        if positions is not None:
            self.order = torch.argsort(self.gathered(positions.reshape(-1)))

    def in_sequence_order(self, rows: torch.Tensor, batch: int) -> torch.Tensor:
        """Gathered rows (rank after rank, each its batch × positions) in one rank's order:
        sequence after sequence, position after position."""
        if self.order is None:
            return rows
        per_rank = rows.view(self.ranks, batch, -1, *rows.shape[1:]).transpose(0, 1)
        return per_rank.reshape(batch, -1, *rows.shape[1:])[:, self.order.to(rows.device)].reshape(rows.shape)

    def this_ranks(self, rows: torch.Tensor, batch: int) -> torch.Tensor:
        """This rank's rows of rows in one rank's order (the inverse of :meth:`in_sequence_order`)."""
        if self.order is None:
            share = len(rows) // self.ranks
            return rows[self.rank * share : (self.rank + 1) * share]
        mine = self.order.argsort().view(self.ranks, -1)[self.rank].to(rows.device)
        return rows.view(batch, -1, *rows.shape[1:])[:, mine].reshape(-1, *rows.shape[1:])

    def summed(self, tensor: torch.Tensor) -> torch.Tensor:
        """Over the ranks (a copy; not differentiated: counts)."""
        import torch.distributed as dist

        total = tensor.detach().clone()
        dist.all_reduce(total, group=self.group)
        return total

    def gathered(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's rows, in rank order (not differentiated: a choice)."""
        import torch.distributed as dist

        parts = [torch.empty_like(tensor) for _ in range(self.ranks)]
        dist.all_gather(parts, tensor.detach().contiguous(), group=self.group)
        return torch.cat(parts)


class AuxLossScaler(torch.autograd.Function):
    """Megatron-Core's ``MoEAuxLossAutoScaler``: the activations pass unchanged, and in backward
    the routers' losses get a gradient of one — so a pipeline stage adds them to what is
    optimized although the loss it could add them to is computed on the last stage (the schedule
    scales each micro-batch's gradients as it scales that loss's)."""

    @staticmethod
    def forward(ctx: Any, activations: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return activations

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss)


def stage_values(
    layers: dict[int, MoE], n_layer: int, device: torch.device, micro_batches: int
) -> dict[str, torch.Tensor]:
    """A stage's part of the step's logged values, as :func:`moe_outputs` names them: each of
    its layers' stats averaged over the step's ``micro_batches`` (its last forwards: a stage's
    first forward, on uninitialized tensors of the right shape, only tells the pipeline its
    shapes), and their sums (zeros for the layers other stages hold, so that summing over the
    stages gives the model's). Empties the layers' histories."""
    names = ("aux_loss", "z_loss", "load_min", "load_max")
    zero = torch.zeros((), device=device)
    values: dict[str, torch.Tensor] = {"moe_aux_loss": zero, "moe_z_loss": zero}
    for i in range(n_layer):
        kept = layers[i].history if i in layers else None
        history = kept[-micro_batches:] if kept else []
        means = {name: torch.stack([h[name] for h in history]).mean() for name in names} if history else {}
        values.update({f"moe/layer{i}/{name}": means.get(name, zero) for name in names})
        values["moe_aux_loss"] = values["moe_aux_loss"] + means.get("aux_loss", zero)
        values["moe_z_loss"] = values["moe_z_loss"] + means.get("z_loss", zero)
        if kept is not None:
            kept.clear()
    return values


def with_router_losses(activations: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    """``activations`` unchanged, ``loss`` joined to what backward optimizes (:class:`AuxLossScaler`)."""
    out: torch.Tensor = AuxLossScaler.apply(activations, loss)  # type: ignore[no-untyped-call]
    return out
