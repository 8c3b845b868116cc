"""``expert-parallel``: a mixture of experts' experts spread over groups of ranks, each token
sent to its experts' rank and back by all-to-all (``distributed.ep_size``).

    [distributed]
    strategy = "fsdp"     # "auto" picks it with ep_size > 1
    ep_size = 2           # a divisor of one replica's data-parallel ranks × cp_size

The experts are what the model's provider answers to this plugin's ``expert_layers`` hook
(:mod:`coretrain_expert_parallel.hookspecs`: one module per layer with ``n_experts``,
``expert_rows`` and ``dispatch``, parameters stacked expert first): the gpt provider's, and the
hf provider's adapters of transformers' stacked experts (Mixtral, Qwen-MoE, DeepSeek-V3).

The ranks form expert groups of ``ep_size`` (torchtitan's ``dp_shard_in_ep × cp``: neighbouring
data-parallel ranks, and whole context groups); each rank of a group holds n_experts / ep_size
experts, and the groups hold copies of the same experts, which FSDP2 shards over the ranks
holding them (``dp_shard_mod_ep``, with HSDP its replicas too). Each rank keeps its slice of
the experts' dimension as a DTensor sharded over the expert group, so clipping, the optimizer
and DCP checkpoints see one kind of parameter, and a checkpoint holds the whole stacked tensors
under their names: it resumes with another ``ep_size`` or on one rank.

A step on each rank routes its own tokens; the tokens bound for another rank's experts travel
there in one all-to-all per MoE layer (their counts in one before it: a host sync per layer, as
Megatron's dispatcher has), are computed there, and come back in one more, summed in the same
order as on one rank. Every rank of its group sends tokens to an expert, so its gradient holds
their losses: averaged over every data-parallel and context rank, as FSDP averages the others'.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, cast

from attrs import define

from coretrain import DistInfo, Run, UserError, hookimpl
from coretrain_expert_parallel.hookspecs import ExpertSpecs

log = logging.getLogger("coretrain")


class AllToAll:
    """The dispatcher a MoE layer calls in place of running every expert itself."""

    def __init__(self, group: Any, ranks: int, rank: int, per_rank: int) -> None:
        self.group, self.ranks, self.rank, self.per_rank = group, ranks, rank, per_rank

    def __call__(self, experts: Any, tokens: Any, kept: Any, weights: Any) -> Any:
        import torch
        import torch.distributed as dist

        token_idx, expert_idx = kept.nonzero(as_tuple=True)  # by token, then expert
        order = torch.argsort(expert_idx, stable=True)  # by expert (so by rank), tokens in order
        token_idx, expert_idx = token_idx[order], expert_idx[order]
        send = torch.bincount(expert_idx // self.per_rank, minlength=self.ranks)
        receive = torch.empty_like(send)
        dist.all_to_all_single(receive, send, group=self.group)
        sent, received = send.tolist(), receive.tolist()  # the host sync: split sizes
        their_experts = expert_idx.new_empty(sum(received))
        dist.all_to_all_single(their_experts, expert_idx, received, sent, group=self.group)
        outgoing = tokens[token_idx]
        # the experts' weight gradients, summed over the group's tokens, become their mean over the
        # group's ranks (the groups' copies are then averaged by FSDP); the tokens' own come back whole
        arrived = scaled_gradient(exchange(outgoing, received, sent, self.group), self.ranks)
        mine = their_experts - self.rank * self.per_rank
        computed = experts.expert_rows(arrived, mine)  # (every local expert gets a gradient, of no tokens too)
        back = exchange(scaled_gradient(computed, 1 / self.ranks), sent, received, self.group)
        scaled = back * weights[token_idx, expert_idx, None].to(tokens.dtype)
        return torch.zeros_like(tokens).index_add(0, token_idx, scaled)


def scaled_gradient(tensor: Any, factor: float) -> Any:
    """``tensor`` as it is; in backward its gradient times ``factor``."""
    return scale_function().apply(tensor, factor)


@functools.cache
def scale_function() -> Any:
    import torch

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, tensor: Any, factor: float) -> Any:
            ctx.factor = factor
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            return grad * ctx.factor, None

    return Scale


def exchange(rows: Any, receive: list[int], send: list[int], group: Any) -> Any:
    """All-to-all of ``rows``: ``send[r]`` of them to rank r, ``receive[r]`` from it; in backward
    the gradients go back the way the rows came."""
    return exchange_function().apply(rows, receive, send, group)


@functools.cache
def exchange_function() -> Any:
    """The differentiable all-to-all, defined once (torch is imported when a run uses it)."""
    import torch
    import torch.distributed as dist

    class Exchange(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, part: Any, receive: list[int], send: list[int], group: Any) -> Any:
            ctx.receive, ctx.send, ctx.group = receive, send, group
            out = part.new_empty(sum(receive), *part.shape[1:])
            dist.all_to_all_single(out, part.contiguous(), receive, send, group=group)
            return out

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
            dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive, group=ctx.group)
            return out, None, None, None

    return Exchange


@define
class ExpertParallel:
    """Spread a mixture of experts' experts over expert groups of ranks (all-to-all dispatch),
    each group's spread copy sharded by FSDP over the ranks holding the same experts."""

    @hookimpl
    def check_layout(self, config: Any, world_size: int) -> None:
        """Said once for a job, before any rank starts (:func:`check_expert_groups`)."""
        check_expert_groups(config.distributed, world_size)

    @hookimpl(tryfirst=True)  # before FSDP shards the rest
    def configure_model(self, run: Run) -> None:
        import torch
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        ep = run.config.distributed.ep_size
        layers = cast(ExpertSpecs, run.plugins.calls.hook).expert_layers(run=run, model=run.model)
        if not layers:
            raise UserError(
                f"distributed.ep_size ({ep}): the model has no experts to spread (the gpt provider's "
                "model.options.n_experts makes a mixture of experts; the hf provider's are transformers' "
                "stacked experts: Mixtral, Qwen-MoE, DeepSeek-V3, ... with transformers >= 5)"
            )
        n_experts: int = layers[0].n_experts
        if n_experts % ep:
            raise UserError(f"distributed.ep_size ({ep}) must divide model.options.n_experts ({n_experts})")
        if run.config.distributed.resolved_strategy(run.dist.world_size) != "fsdp":
            raise UserError(
                f'distributed.ep_size ({ep}): expert parallelism runs on FSDP: set distributed.strategy = "fsdp"'
            )
        mesh = experts_mesh(run)
        spread_over, copies = mesh["ep"], mesh["edp"]
        tp = run.dist.tp_size
        for layer in layers:
            tensor_split = tensor_split_of(layer, tp)
            for name, param in list(layer.named_parameters()):
                module_name, _, attribute = name.rpartition(".")
                module = layer.get_submodule(module_name)
                if tp == 1:
                    placed = distribute_tensor(param.detach(), spread_over, [Shard(0)])
                else:  # each expert's share of hidden units on the tensor-parallel ranks, as they split it
                    dim = tensor_split[name]
                    placements = [Shard(0), Replicate() if dim is None else Shard(dim)]
                    placed = distribute_tensor(param.detach(), mesh[("ep", "tp")], placements)
                setattr(module, attribute, torch.nn.Parameter(placed))
            shard_copies(layer, copies)
            layer.dispatch = AllToAll(spread_over.get_group(), ep, spread_over.get_local_rank(), n_experts // ep)
        if run.dist.is_main:
            name, first = next(iter(layers[0].named_parameters()))
            log.info(
                "expert-parallel: %d experts in each of %d layers, %d on each of %d ranks (this rank's "
                "experts.%s: %s), tokens sent to them by all-to-all; each group's copy sharded over %d",
                *(n_experts, len(layers), n_experts // ep, ep, name, tuple(local_shape(first)), copies.size()),
            )


def check_expert_groups(distributed: Any, world_size: int) -> None:
    """Experts spread over data-parallel ranks of one replica and, with context parallelism,
    over whole context groups (torchtitan's ep = dp_shard_in_ep × cp), on FSDP2. ``distributed``
    is the config's table, whose grid the core has checked."""
    ep, cp = distributed.ep_size, distributed.cp_size
    if ep == 1:
        return
    if distributed.strategy not in ("auto", "fsdp"):
        raise UserError(
            f'distributed.ep_size ({ep}): expert parallelism runs on FSDP2, not strategy = "{distributed.strategy}"; '
            'set distributed.strategy = "fsdp" (or "auto")'
        )
    layout = DistInfo(world_size=world_size, tp_size=distributed.tp_size, cp_size=cp, pp_size=distributed.pp_size)
    shards = layout.dp_size // distributed.dp_replicate
    if (shards * cp) % ep:
        raise UserError(
            f"distributed.ep_size ({ep}) must divide the ranks of one data-parallel replica times cp_size "
            f"({shards} × {cp} = {shards * cp}): the experts are spread over them"
        )
    if ep % cp:
        raise UserError(
            f"distributed.ep_size ({ep}) must be a multiple of distributed.cp_size ({cp}): an expert group "
            "takes whole context groups (the ranks that split one sequence)"
        )


def tensor_split_of(experts: Any, tp: int) -> dict[str, int | None]:
    """How the experts' model splits each of their parameters over tensor-parallel ranks
    (``TENSOR_SPLIT``: name -> the dimension, or None for whole), when there are some."""
    split: dict[str, int | None] | None = getattr(experts, "TENSOR_SPLIT", None)
    if tp > 1 and split is None:
        raise UserError(
            f"distributed.tp_size ({tp}) with distributed.ep_size: the model's experts "
            f"({type(experts).__name__}) do not say how tensor parallelism splits them (a TENSOR_SPLIT "
            "attribute: parameter name -> dimension); set tp_size = 1"
        )
    return split or {}


def experts_mesh(run: Run) -> Any:
    """The experts' mesh: "edp" the ranks holding copies of the same experts, "ep" the ranks
    one expert group spreads over, "tp" the tensor-parallel ranks. Without TP the run's mesh
    (the experts are on "ep" alone, and no more groups are made); with TP its dims of those names
    (a pipeline stage's) as a root mesh of its own: there they are flattened from others, and
    torch 2.11's DTensor cannot reduce over several flattened dims — the norm of the experts'
    gradients, which gradient clipping takes, stopped expert × tensor parallelism."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = run.device_mesh()
    if run.dist.tp_size == 1:
        return mesh
    sizes = {"pp": run.dist.pp_size, "edp": mesh["edp"].size(), "ep": mesh["ep"].size(), "tp": run.dist.tp_size}
    return init_device_mesh(run.device.type, tuple(sizes.values()), mesh_dim_names=tuple(sizes))


def shard_copies(experts: Any, copies: Any) -> None:
    """FSDP2 over the ranks holding the same experts (torchtitan's dp_shard_mod_ep), before the
    blocks are sharded (a module sharded first keeps its own parameters); it averages the copies'
    gradients over those ranks."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(experts, mesh=copies)


def local_shape(tensor: Any) -> Any:
    """The shape of this rank's part of a DTensor."""
    return tensor.to_local().shape if hasattr(tensor, "to_local") else tensor.shape
