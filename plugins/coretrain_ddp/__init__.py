"""``ddp``: data parallelism with torch's DistributedDataParallel.

Enabled by ``distributed.strategy = "ddp"`` (the default when torchrun starts more than one
rank) or a ``[plugins.ddp]`` table. Wraps the model last (``trylast``), after numerics
and compilation plugins have changed it. Gradients are averaged over ranks during backward;
the loop skips the all-reduce on all but the last micro-batch (``no_sync``).
"""

from __future__ import annotations

import logging

from attrs import define

from coretrain import Run, hookimpl

log = logging.getLogger("coretrain")


@define(kw_only=True)
class DDP:
    """DistributedDataParallel: replicate the model, average gradients over ranks."""

    bucket_cap_mb: int = 25
    """Gradient bucket size for overlapping all-reduce with backward."""
    find_unused_parameters: bool = False
    """Needed only when some parameters get no gradient in a step (costs a graph walk)."""
    gradient_as_bucket_view: bool = True
    """Let gradients alias the communication buckets (saves one copy of the gradients)."""
    static_graph: bool = False
    """Promise the autograd graph is the same every step (enables more overlap)."""

    @hookimpl(trylast=True)
    def configure_model(self, run: Run) -> None:
        if run.dist.tp_size > 1:
            from coretrain import UserError

            raise UserError(
                "plugins.ddp: DDP cannot average gradients of tensor-parallel (DTensor) weights; "
                f'with distributed.tp_size = {run.dist.tp_size} use distributed.strategy = "fsdp" (or "auto")'
            )
        if run.dist.world_size == 1:
            log.info("ddp: single process, model left unwrapped")
            return
        from coretrain import is_sharded

        if is_sharded(run.model):
            log.info("ddp: the model is already sharded (fsdp); not wrapping it again")
            return
        from torch.nn.parallel import DistributedDataParallel

        run.model = DistributedDataParallel(
            run.model,
            device_ids=[run.device.index] if run.device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
        )
