"""This rank's pipeline stage, the schedules that run it, and what crosses stages: the tied
weights' gradients, the gradient norm, an evaluation's loss."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

from coretrain import Run, UserError

if TYPE_CHECKING:
    from coretrain_pipeline_parallel.hookspecs import PipelineSpecs

log = logging.getLogger("coretrain")

SCHEDULES = {"1F1B": "Schedule1F1B", "GPipe": "ScheduleGPipe"}


def stage_sizes(layers: int, stages: int, split: list[int] | None) -> list[int]:
    """Blocks on each stage: ``split`` as given (checked), else an equal share each."""
    if split is not None:
        if len(split) != stages or sum(split) != layers or min(split) < 1:
            raise UserError(
                f"plugins.pipeline-parallel.pp_split: {split} must give each of the {stages} stages at least "
                f"one block, {layers} blocks in all"
            )
        return list(split)
    if layers % stages:
        raise UserError(
            f"distributed.pp_size ({stages}) must divide the model's {layers} blocks, or place them by hand: "
            "[plugins.pipeline-parallel] pp_split = [...] (blocks per stage)"
        )
    return [layers // stages] * stages


def tie_group(run: Run, stages: int) -> Any:
    """The group of this rank's first and last stage (every rank makes every such group, in order)."""
    mesh = run.device_mesh()
    if stages == 2:
        return mesh["pp"].get_group()
    mine = None
    for column in mesh.mesh.reshape(stages, -1).T.tolist():
        group = dist.new_group([column[0], column[-1]])
        mine = group if dist.get_rank() in (column[0], column[-1]) else mine
    return mine


class Pipeline:
    """This rank's stage of the model and the schedules that run it (made at the first step,
    around the model as its wrappers left it)."""

    def __init__(
        self, run: Run, index: int, stages: int, split: dict[str, Any], schedule: str, microbatches: int | None
    ):
        self.run, self.index, self.stages = run, index, stages
        self.first, self.last = index == 0, index == stages - 1
        self.loss, self.schedule_name, self.microbatches = split["loss"], schedule, microbatches
        self.group = run.device_mesh()["pp"].get_group()
        self.tied = (
            [pair[0] if self.first else pair[1] for pair in split.get("tied", [])] if self.first or self.last else []
        )
        self.tie_group = tie_group(run, stages) if split.get("tied") else None
        self._schedules: dict[tuple[int, bool], Any] = {}

    @classmethod
    def of(cls, run: Run, schedule: str, microbatches: int | None, sizes_by_hand: list[int] | None) -> Pipeline:
        """Cut ``run.model`` into stages and keep this rank's as the run's model."""
        mesh = run.device_mesh()["pp"]
        stages, index = mesh.size(), mesh.get_local_rank()
        hooks = cast("PipelineSpecs", run.plugins.calls.hook)
        split = hooks.pipeline_split(run=run, model=run.model) if run.plugins.implemented("pipeline_split") else None
        if split is None:
            raise UserError(
                f"distributed.pp_size ({stages}): the model provider '{run.config.model.provider}' does not cut "
                f"its {type(run.model).__name__} into pipeline stages (the gpt provider's model is cut by block)"
            )
        count = microbatches or run.micro_batches_per_step
        if schedule == "1F1B" and count < stages:
            raise UserError(
                f"distributed.pp_size ({stages}): the 1F1B schedule needs at least as many micro-batches per step as "
                f"stages, and a step has {count} (global_batch_size / micro_batch_size / data parallel, or "
                '[plugins.pipeline-parallel] pp_microbatches): raise global_batch_size, or use pp_schedule = "GPipe"'
            )
        sizes = stage_sizes(split["layers"], stages, sizes_by_hand)
        start = sum(sizes[:index])
        layers = range(start, start + sizes[index])
        run.model = split["stage"](layers, index == 0, index == stages - 1)
        run.reports_loss = index == stages - 1
        if run.dist.is_main:
            log.info("pipeline-parallel: %d stages of %s blocks, %s schedule", stages, sizes, schedule)
        return cls(run, index, stages, split, schedule, microbatches)

    def _schedule(self, count: int, training: bool) -> Any:
        """The schedule for ``count`` micro-batches (GPipe's forwards alone for an evaluation)."""
        if (count, training) not in self._schedules:
            from torch.distributed.pipelining import PipelineStage, schedules

            run = self.run
            stage = PipelineStage(run.model, self.index, self.stages, run.device, group=self.group)
            kind = getattr(schedules, SCHEDULES[self.schedule_name] if training else "ScheduleGPipe")
            self._schedules[count, training] = kind(stage, count, loss_fn=self.loss)
        return self._schedules[count, training]

    def _run(self, batch: tuple[torch.Tensor, torch.Tensor], count: int, training: bool) -> torch.Tensor:
        """The schedule over ``batch`` cut into ``count`` micro-batches; the mean loss on the last stage."""
        inputs, target = batch
        if len(inputs) % count:
            raise UserError(
                f"plugins.pipeline-parallel.pp_microbatches ({count}) must divide this rank's batch of {len(inputs)}"
            )
        losses: list[torch.Tensor] = []
        schedule = self._schedule(count, training)
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
        loss = self._run(joined, self.microbatches or len(batches), training=True)
        for name in self.tied:
            grad = run.model.get_parameter(name).grad
            if grad is not None:
                dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=self.tie_group)
        return loss, {}

    def clip(self, parameters: list[Any], max_norm: float) -> torch.Tensor:
        """Clip to the norm over every stage (a tied weight counted once, on the first stage)."""
        skip = {id(self.run.model.get_parameter(name)) for name in self.tied} if self.last and not self.first else set()
        grads = [p.grad for p in parameters if p.grad is not None and id(p) not in skip]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.run.device)
        squared = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float() ** 2
        dist.all_reduce(squared, group=self.group)
        total = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return total

    def outputs(self, batch: Any) -> tuple[Any, Any]:
        """One prediction batch through the stages: the last stage's outputs (None on the others)."""
        inputs, target = batch
        schedule = self._schedule(1, training=False)  # its loss is computed too: it needs the target
        output = schedule.eval(*((inputs,) if self.first else ()), target=target if self.last else None)
        return (output if self.last else None), target

    def evaluate(self, run: Run, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """One evaluation batch through the stages; its loss sent from the last stage to the others."""
        loss = self._run(batch, 1, training=False)
        dist.broadcast(loss, src=dist.get_global_rank(self.group, self.stages - 1), group=self.group)
        return loss, {}
