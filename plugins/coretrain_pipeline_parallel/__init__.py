"""``pipeline-parallel``: the model's blocks cut into ``distributed.pp_size`` stages, each held by
other ranks, micro-batches flowing through them on ``torch.distributed.pipelining``'s schedules.

    [distributed]
    pp_size = 2                 # data parallel = ranks / pp_size / tp_size / cp_size
    [plugins.pipeline-parallel]
    pp_schedule = "1F1B"        # or "GPipe", "Interleaved1F1B" (pp_virtual_stages per rank),
                                # "ZBVZeroBubble" or "DualPipeV" (two stages per rank, in a V)
    pp_microbatches = 8         # unset: the step's micro-batches (its gradient accumulation)
    pp_split = [3, 5]           # blocks per stage; unset: as many on each

The model provider cuts its model (hook ``pipeline_split``: the ``gpt`` provider's does, by
block, embeddings on the first stage, norm, head and loss on the last), keeping each
parameter's name, so a checkpoint saved on one layout resumes on any other. Stages run on
FSDP2 (over their data-parallel ranks, one or more), which makes the checkpoint sharded by name.
With Interleaved1F1B each rank holds ``pp_virtual_stages`` stages (rank r: stages r, r + pp_size,
...): ``run.model`` holds all of them under their names, and each stage is a view sharing its
modules (``run.model_parts``), which FSDP2 shards as a root of its own. The zero-bubble
schedules (ZBVZeroBubble, DualPipeV) place two stages per rank in a V (rank r: r and
2·pp_size − 1 − r) and split each backward into an input half, sent on at once, and a weight
half run later to fill the bubble; the weight half finds the weights in the autograd graph only
while FSDP keeps them unsharded, so their stages are not resharded after forward (more memory
between a forward and its backward, no all-gather per micro-batch). The first rank holds the
first and the last stage, so a weight tied between them gets a copy on the last (a parameter
is sharded by one FSDP root), its gradient summed with the first's each step. The schedules of
several stages per rank (Interleaved1F1B and the two V-shaped ones) need torch 2.10 or newer:
torch 2.9 evaluates looped stages wrongly and runs a V through sends from a rank to itself.

The step's loss is the last stage's (the other stages log none: ``run.reports_loss``); the
gradient norm for clipping is taken over every stage; a weight the model ties across the first
and last stage (the ``gpt`` head and embedding) has its gradient summed between them each step
— the one collective per step besides the schedule's own sends, as in Megatron. Evaluation runs
through the pipeline (the ``evaluation`` plugin's ``forward_batch``), its loss sent from the last
stage to the others; so does ``coretrain predict`` (the ``predict`` plugin's ``predict_outputs``:
the last stage's outputs are written).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

from attrs import define, field

from coretrain import Run, UserError, hookimpl, positive

if TYPE_CHECKING:
    import torch

log = logging.getLogger("coretrain")


@define(kw_only=True)
class PipelineParallel:
    """Cut the model into stages over distributed.pp_size ranks; run each step as a pipeline schedule."""

    pp_schedule: Literal["1F1B", "GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"] = "1F1B"
    """The schedule: 1F1B (one forward, one backward: activations of at most pp_size
    micro-batches held), GPipe (all forwards, then all backwards), Interleaved1F1B
    (pp_virtual_stages stages per rank, looped over the ranks: a smaller bubble), or a
    zero-bubble one, ZBVZeroBubble or DualPipeV (two stages per rank in a V, each backward
    split into input and weight halves; DualPipeV needs 2 × pp_size micro-batches or more)."""
    pp_virtual_stages: int = field(default=2, validator=positive)
    """Stages per rank with Interleaved1F1B (torch's interleaved schedule); the V-shaped
    schedules always hold two."""
    pp_microbatches: int | None = field(default=None, validator=positive)
    """Micro-batches each step's batch is cut into for the pipeline; unset = the step's
    micro-batches (train.global_batch_size / micro_batch_size / data parallel)."""
    pp_split: list[int] | None = None
    """Blocks on each stage, first to last (e.g. [3, 5]: fewer on the first, which also embeds);
    unset = as many on each (pp_size must divide the blocks)."""

    _parts: Any = field(default=None, init=False, repr=False)

    @hookimpl
    def check_layout(self, config: Any, world_size: int, hooks: Any) -> None:
        """The schedule takes a step's micro-batches on these ranks, and the model's blocks (when
        its provider knows them from the config) go into the stages (said once for a job)."""
        from coretrain_pipeline_parallel.stages import check_micro_batches, local_stages, stage_sizes

        layout, train = config.distributed, config.train
        if layout.pp_size == 1:
            return
        per_pass = train.micro_batch_size * max(world_size // (layout.pp_size * layout.tp_size * layout.cp_size), 1)
        count = self.pp_microbatches or (train.global_batch_size or per_pass) // per_pass
        check_micro_batches(self.pp_schedule, layout.pp_size, count)
        blocks = hooks.pipeline_blocks(config=config) if hasattr(hooks, "pipeline_blocks") else None
        if blocks is not None:
            per_rank = len(local_stages(self.pp_schedule, layout.pp_size, 0, self.pp_virtual_stages))
            stage_sizes(blocks, layout.pp_size * per_rank, self.pp_split, per_rank)

    @hookimpl(tryfirst=True)  # on the model as built: tensor parallelism and FSDP wrap the stage
    def configure_model(self, run: Run) -> None:
        from coretrain_pipeline_parallel.stages import Pipeline

        if run.dist.pp_size == 1:
            raise UserError(
                "plugins.pipeline-parallel: distributed.pp_size is 1, so there is nothing to cut into stages; "
                "set distributed.pp_size = 2 (or more), or remove [plugins.pipeline-parallel]"
            )
        self._parts = Pipeline.of(run, self)

    @hookimpl
    def forward_backward(self, run: Run, batches: list[Any]) -> Any:
        return self._parts.train_step(run, batches)

    @hookimpl
    def clip_gradients(self, run: Run, parameters: list[torch.nn.Parameter], max_norm: float) -> Any:
        return self._parts.clip(parameters, max_norm)

    @hookimpl
    def forward_batch(self, run: Run, batch: Any) -> Any:
        return self._parts.evaluate(run, batch)

    @hookimpl
    def predict_outputs(self, run: Run, batch: Any) -> Any:
        return self._parts.outputs(batch)
