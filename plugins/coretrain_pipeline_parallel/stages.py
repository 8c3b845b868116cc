"""This rank's pipeline stages, the schedules that run them, and what crosses stages: the tied
weights' gradients, the gradient norm, an evaluation's loss."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, schedules
from torch.distributed.pipelining.schedules import ScheduleLoopedBFS, _Action, _ComputationType
from torch.torch_version import TorchVersion

from coretrain import SHARED_PARAMETERS, Run, UserError, clip_to, gradient_norm

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

    from coretrain_pipeline_parallel import PipelineParallel
    from coretrain_pipeline_parallel.hookspecs import PipelineSpecs

log = logging.getLogger("coretrain")

SCHEDULES = {
    "1F1B": "Schedule1F1B",
    "GPipe": "ScheduleGPipe",
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
    "DualPipeV": "ScheduleDualPipeV",
}
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # two stages per rank, down the ranks and back up


def stage_sizes(layers: int, stages: int, split: list[int] | None, per_rank: int = 1) -> list[int]:
    """Blocks on each stage: ``split`` as given (checked), else an equal share each."""
    if split is not None:
        if len(split) != stages or sum(split) != layers or min(split) < 1:
            raise UserError(
                f"plugins.pipeline-parallel.pp_split: {split} must give each of the {stages} stages at least "
                f"one block, {layers} blocks in all"
            )
        return list(split)
    if layers % stages:
        many = f" × {per_rank} stages per rank" if per_rank > 1 else ""
        raise UserError(
            f"distributed.pp_size ({stages // per_rank}){many} must divide the model's {layers} blocks, or place "
            "them by hand: [plugins.pipeline-parallel] pp_split = [...] (blocks per stage)"
        )
    return [layers // stages] * stages


def local_stages(schedule: str, ranks: int, rank: int, virtual: int) -> list[int]:
    """The stages this rank holds: one, ``virtual`` looped over the ranks (interleaved), or two
    in a V (rank r: r and 2·pp_size − 1 − r, so the first rank holds the first and last)."""
    if schedule in V_SHAPED:
        return [rank, 2 * ranks - 1 - rank]
    return [rank + k * ranks for k in range(virtual if schedule == "Interleaved1F1B" else 1)]


def check_torch_runs(schedule: str) -> None:
    """Schedules of several stages per rank on torch 2.9: its evaluation of looped ones is wrong
    (NaN, or another loss each run, though training matches) and it runs V-shaped ones through
    sends from a rank to itself, which gloo cannot do."""
    if schedule in ("Interleaved1F1B", *V_SHAPED) and TorchVersion(torch.__version__) < "2.10":
        raise UserError(
            f"plugins.pipeline-parallel.pp_schedule = {schedule!r} needs torch 2.10 or newer (this is "
            f'{torch.__version__}): upgrade torch, or use pp_schedule = "1F1B"'
        )


def check_micro_batches(schedule: str, ranks: int, count: int) -> None:
    """A step of ``count`` micro-batches fits ``schedule`` on ``ranks`` stages' ranks."""
    if schedule == "1F1B" and count < ranks:
        raise UserError(
            f"distributed.pp_size ({ranks}): the 1F1B schedule needs at least as many micro-batches per step as "
            f"stages, and a step has {count} (global_batch_size / micro_batch_size / data parallel, or "
            '[plugins.pipeline-parallel] pp_microbatches): raise global_batch_size, or use pp_schedule = "GPipe"'
        )
    if schedule == "Interleaved1F1B" and count % max(1, count // ranks):
        raise UserError(
            f"plugins.pipeline-parallel: the Interleaved1F1B schedule takes the step's {count} micro-batches in "
            f"rounds of pp_size ({ranks}): make them a multiple of {ranks}, or fewer than {2 * ranks}"
        )
    if schedule == "DualPipeV" and count < 2 * ranks:
        raise UserError(
            f"distributed.pp_size ({ranks}): the DualPipeV schedule needs at least as many micro-batches per step "
            f"as stages ({2 * ranks}: two per rank), and a step has {count}: raise global_batch_size or "
            'pp_microbatches, or use pp_schedule = "ZBVZeroBubble"'
        )


def fewest_for(schedule: str, ranks: int) -> int:
    """The fewest micro-batches a step must have for ``schedule`` (fewer run as GPipe)."""
    return {"GPipe": 1, "DualPipeV": 2 * ranks}.get(schedule, ranks)


def first_micro_batches(run: Run, count: int) -> int:
    """The micro-batches of a fresh run's first step: fewer than ``count`` with a batch-size
    rampup (the ``num_micro_batches`` hook), else ``count``."""
    if not run.plugins.implemented("num_micro_batches"):
        return count
    first = run.plugins.calls.hook.num_micro_batches(run=run, step=1, consumed_samples=0)
    return min(count, int(first)) if first else count


def untie(model: torch.nn.Module, tied: list[tuple[str, str]]) -> None:
    """Give each tied pair's second name a weight of its own: one rank holds both stages, each an
    FSDP2 root of its own, and a parameter sharded by two roots is not. Their gradients are
    summed each step, so the two stay equal (same start, same updates)."""
    for first, second in tied:
        owner, _, name = second.rpartition(".")
        weight = model.get_parameter(first)
        setattr(model.get_submodule(owner), name, torch.nn.Parameter(weight.detach().clone()))


def tie_group(run: Run, ranks: int) -> Any:
    """The group of this rank's first and last stage's ranks (every rank makes every such group)."""
    mesh = run.device_mesh()
    if ranks == 2:
        return mesh["pp"].get_group()
    mine = None
    for column in mesh.mesh.reshape(ranks, -1).T.tolist():
        group = dist.new_group([column[0], column[-1]])
        mine = group if dist.get_rank() in (column[0], column[-1]) else mine
    return mine


class Stage(PipelineStage):
    """torch's stage, whose first exchange with its neighbours gloo can do. Before torch 2.12 a
    schedule opens by sending each stage's neighbours a tensor: in a V the next stage after a
    rank's first is on the same rank — a send to itself, which gloo cannot do ("Pair is not
    connected"), so it is left out; and torch 2.9 sends an int64 into a float32 buffer, which
    gloo aborts on (the sizes differ), so every tensor is float32, as torch 2.10 has it. Later
    torch opens otherwise and never asks for these."""

    def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
        ops = [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]
        for op in ops:
            op.tensor = op.tensor.float()
        return ops


class GPipe(schedules.ScheduleGPipe):
    """torch's GPipe, also over fewer micro-batches than stages (an evaluation's one, a rampup's
    small steps): torch 2.9 refuses them for every single-stage schedule, later torch only for
    1F1B, whose interleaving needs them; all forwards, then all backwards, need not."""

    def __init__(self, stage: PipelineStage, n_microbatches: int, **kwargs: Any) -> None:
        super().__init__(stage, max(n_microbatches, stage.num_stages), **kwargs)
        self._n_microbatches = n_microbatches
        self.pipeline_order = self._get_pipeline_order()


def schedule_class(name: str) -> Any:
    """torch's schedule of that class name, or this module's version of it."""
    return GPipe if name == "ScheduleGPipe" else getattr(schedules, name)


class VShapedForwards(ScheduleLoopedBFS):
    """Forwards alone, breadth first, over two stages per rank placed in a V (torch's LoopedBFS
    places them in a loop; its V-shaped schedules have no forward-only run)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        backward = {_ComputationType.FULL_BACKWARD, _ComputationType.SEND_B, _ComputationType.RECV_B}
        for rank, actions in self.pipeline_order_with_comms.items():  # an eval runs none of them
            self.pipeline_order_with_comms[rank] = [a for a in actions if a.computation_type not in backward]

    def _calculate_single_rank_operations(self, rank: int) -> list[_Action | None]:
        held, count = local_stages("ZBVZeroBubble", self.pp_group_size, rank, 2), self._n_microbatches
        operations: list[_Action | None] = [None] * rank
        for stage in held:
            operations += [_Action(stage, _ComputationType.FORWARD, mb) for mb in range(count)]
        for stage in reversed(held):  # torch checks that a schedule holds them (dropped above)
            operations += [_Action(stage, _ComputationType.FULL_BACKWARD, mb) for mb in reversed(range(count))]
        return operations


class Pipeline:
    """This rank's stages of the model and the schedules that run them (made at the first step,
    around the stages as their wrappers left them)."""

    def __init__(self, run: Run, held: list[int], total: int, split: dict[str, Any], settings: PipelineParallel):
        self.run, self.held, self.total = run, held, total
        self.first, self.last = 0 in held, total - 1 in held
        self.loss, self.schedule_name, self.microbatches = split["loss"], settings.pp_schedule, settings.pp_microbatches
        self.values, self.adds_to_loss = split.get("values"), list(split.get("adds_to_loss", []))
        self.loss_value: str | None = split.get("loss_value")
        self.group = run.device_mesh()["pp"].get_group()
        ranks = self.group.size()
        self.tied = [pair for pair in split.get("tied", []) if self.first or self.last]
        crossing = split.get("tied") and settings.pp_schedule not in V_SHAPED  # in a V, one rank holds both
        self.tie_group = tie_group(run, ranks) if crossing else None
        self._schedules: dict[tuple[int, bool, tuple[int, ...]], Any] = {}

    @classmethod
    def of(cls, run: Run, settings: PipelineParallel) -> Pipeline:
        """Cut ``run.model`` into stages and keep this rank's: as the run's model (one stage) or
        as its parts over a model holding them all under their names (several)."""
        mesh = run.device_mesh()["pp"]
        ranks, rank, schedule = mesh.size(), mesh.get_local_rank(), settings.pp_schedule
        hooks = cast("PipelineSpecs", run.plugins.calls.hook)
        split = hooks.pipeline_split(run=run, model=run.model) if run.plugins.implemented("pipeline_split") else None
        if split is None:
            raise UserError(
                f"distributed.pp_size ({ranks}): the model provider '{run.config.model.provider}' does not cut "
                f"its {type(run.model).__name__} into pipeline stages (the gpt provider's model is cut by block)"
            )
        check_torch_runs(schedule)
        count = settings.pp_microbatches or run.micro_batches_per_step
        check_micro_batches(schedule, ranks, count)
        fewest = first_micro_batches(run, count)
        if schedule in V_SHAPED and fewest < fewest_for(schedule, ranks) and not settings.pp_microbatches:
            raise UserError(
                f"plugins.batch-rampup.rampup_batch_size: the first steps have {fewest} micro-batch(es), fewer than "
                f"the {schedule} schedule runs ({fewest_for(schedule, ranks)}); start the ramp at a larger batch, set "
                '[plugins.pipeline-parallel] pp_microbatches, or use pp_schedule = "1F1B" (small steps run as GPipe)'
            )
        held = local_stages(schedule, ranks, rank, settings.pp_virtual_stages)
        total = ranks * len(held)
        sizes = stage_sizes(split["layers"], total, settings.pp_split, len(held))
        blocks = {s: list(range(sum(sizes[:s]), sum(sizes[: s + 1]))) for s in held}
        first, last = 0 in held, total - 1 in held
        run.model = split["stage"](sorted(i for s in held for i in blocks[s]), first, last)
        if first and last:
            untie(run.model, split.get("tied", []))
        if last and split.get("tied"):  # whole-model figures count a tied weight once, where it is first named
            setattr(run.model, SHARED_PARAMETERS, {second: first for first, second in split["tied"]})
        if len(held) > 1:  # each stage a view over the run's model, sharing its modules
            run.model_parts = [split["stage"](blocks[s], s == 0, s == total - 1) for s in held]
        run.reports_loss = last
        if run.dist.is_main:
            log.info("pipeline-parallel: %d stages of %s blocks, %s schedule", total, sizes, schedule)
        return cls(run, held, total, split, settings)

    def _parts(self) -> list[torch.nn.Module]:
        return self.run.model_parts or [self.run.model]

    def _follow_mode(self) -> None:
        """Put this rank's stages in the run's model's mode: views over it are not its
        submodules, so its ``train()`` and ``eval()`` do not reach their own flags."""
        for part in self.run.model_parts:
            part.train(self.run.model.training)

    def _schedule(self, count: int, training: bool, shape: tuple[int, ...] = ()) -> Any:
        """The schedule for ``count`` micro-batches of a batch of ``shape`` (forwards alone,
        breadth first, for an evaluation). One per shape: a stage keeps the shapes its first
        micro-batch had (an evaluation's last, partial batch has others)."""
        key = (count, training, shape)
        if key not in self._schedules:
            run, single, v_shaped = self.run, len(self.held) == 1, self.schedule_name in V_SHAPED
            if v_shaped:  # the weight half of a backward finds the weights in the graph only unsharded
                self._check_uncompiled()
                for part in self._parts():
                    cast("FSDPModule", part).set_reshard_after_forward(False)
            stages = [
                Stage(part, s, self.total, run.device, group=self.group) for part, s in zip(self._parts(), self.held)
            ]
            name = SCHEDULES[self.schedule_name] if training else "ScheduleGPipe" if single else "ScheduleLoopedBFS"
            if training and not v_shaped and count < fewest_for(self.schedule_name, self.group.size()):
                name = "ScheduleGPipe" if single else "ScheduleLoopedBFS"  # a rampup's small steps: the same numbers
                if run.dist.is_main:
                    log.info("pipeline-parallel: steps of %d micro-batch(es) run as %s", count, name[8:])
            kind = VShapedForwards if v_shaped and not training else schedule_class(name)
            self._schedules[key] = kind(stages[0] if single else stages, count, loss_fn=self.loss)
        return self._schedules[key]

    def _check_uncompiled(self) -> None:
        """A split backward runs a compiled backward twice, which torch does not allow (its own
        check sees only ``torch.compile(module)``, not ``module.compile()``)."""
        parts = self._parts()
        if any(getattr(m, "_compiled_call_impl", None) is not None for part in parts for m in part.modules()):
            raise UserError(
                f"plugins.pipeline-parallel.pp_schedule = {self.schedule_name!r} splits each backward into input and "
                "weight halves, which torch does not run on compiled stages: drop [plugins.compile], or use "
                'pp_schedule = "Interleaved1F1B"'
            )

    def _run(self, batch: tuple[torch.Tensor, torch.Tensor], count: int, training: bool) -> torch.Tensor:
        """The schedule over ``batch`` cut into ``count`` micro-batches; the mean loss on the last stage."""
        inputs, target = batch
        if len(inputs) % count:
            raise UserError(
                f"plugins.pipeline-parallel.pp_microbatches ({count}) must divide this rank's batch of {len(inputs)}"
            )
        losses: list[torch.Tensor] = []
        self._follow_mode()
        schedule = self._schedule(count, training, tuple(inputs.shape))
        run_it = schedule.step if training else schedule.eval
        run_it(
            *((inputs,) if self.first else ()),
            target=target if self.last else None,
            losses=losses if self.last else None,
        )
        if self.last:
            return torch.stack(losses).float().mean().detach()
        return torch.zeros((), device=self.run.device)

    def train_step(self, run: Run, batches: list[Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The step through the pipeline; the tied weights' gradients summed over their stages."""
        if not all(isinstance(b, (tuple, list)) and len(b) == 2 for b in batches):
            raise UserError(
                "distributed.pp_size: a pipeline takes (inputs, target) batches, as the gpt provider's data has"
            )
        joined = (torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        count = self.microbatches or len(batches)
        loss = self._run(joined, count, training=True)
        for pair in self.tied:
            self._sum_tied(pair)
        return self._with_values(loss, count, training=True)

    def _with_values(
        self, loss: torch.Tensor, micro_batches: int, training: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The stages' shares of the model's named values (``pipeline_split``'s ``values``: a
        mixture of experts' routers' losses and loads) summed over the stages, one all-reduce;
        the last stage's loss under ``loss_value``, and, in training, with ``adds_to_loss`` added
        (what the stages optimized besides it)."""
        if self.values is None:
            return loss, {}
        partial = self.values(self.run.model, micro_batches)
        names = sorted(partial)
        summed = torch.stack([partial[name].float().reshape(()) for name in names])
        dist.all_reduce(summed, group=self.group)
        values = dict(zip(names, summed.unbind()))
        if self.loss_value is not None:
            values[self.loss_value] = loss.detach()
        if training:
            loss = loss + sum((values[name] for name in self.adds_to_loss), torch.zeros_like(loss))
        return loss, values

    def _sum_tied(self, pair: tuple[str, str]) -> None:
        """Sum a tied weight's gradient over the first and last stage: between their ranks, or
        here when this rank holds both (a V-shaped schedule)."""
        here = [name for name, held in zip(pair, (self.first, self.last)) if held]
        grads = [self.run.model.get_parameter(name).grad for name in here]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads if g is not None]
        if self.tie_group is not None:
            for grad in local:
                dist.all_reduce(grad, group=self.tie_group)
        elif len(local) == 2:
            local[0].add_(local[1])
            local[1].copy_(local[0])

    def clip(self, parameters: list[Any], max_norm: float) -> torch.Tensor:
        """Clip to the norm over every stage (a tied weight counted once, on the first stage)."""
        skip = {id(self.run.model.get_parameter(b)) for _, b in self.tied} if self.last else set()
        squared = gradient_norm(p for p in parameters if id(p) not in skip).to(self.run.device) ** 2
        dist.all_reduce(squared, group=self.group)
        total = squared.sqrt()
        clip_to(parameters, max_norm, total)
        return total

    def outputs(self, batch: Any) -> tuple[Any, Any]:
        """One prediction batch through the stages: the last stage's outputs (None on the others)."""
        inputs, target = batch
        self._follow_mode()
        schedule = self._schedule(1, False, tuple(inputs.shape))  # its loss is computed too: it needs the target
        output = schedule.eval(*((inputs,) if self.first else ()), target=target if self.last else None)
        if self.values is not None:
            self.values(self.run.model, 1)  # (the stages' values of a prediction are not logged)
        return (output if self.last else None), target

    def evaluate(self, run: Run, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One evaluation batch through the stages; its loss sent from the last stage to the others."""
        loss = self._run(batch, 1, training=False)
        ranks = self.group.size()
        last_rank = 0 if self.schedule_name in V_SHAPED else (self.total - 1) % ranks  # holds the last stage
        dist.broadcast(loss, src=dist.get_global_rank(self.group, last_rank), group=self.group)
        return self._with_values(loss, 1, training=False)
