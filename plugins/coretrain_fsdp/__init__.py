"""``fsdp``: fully sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Shards each transformer block, then the root (torchtitan's recipe), over the data-parallel
dimension of the run's device mesh (all ranks; with ``distributed.tp_size`` > 1, one rank of
each tensor-parallel group, for 2-D parallelism). Parameters become DTensors, so checkpoints are saved sharded with
torch.distributed.checkpoint and can be resumed on a different number of ranks.
Enable with ``distributed.strategy = "fsdp"`` (options in ``[plugins.fsdp]``).
"""

from __future__ import annotations

from attrs import define, field

from coretrain import Run, blocks_of, hookimpl


@define(kw_only=True)
class FSDP:
    """FSDP2: shard parameters, gradients and optimizer state over ranks, block by block."""

    reshard_after_forward: bool = True
    """Free gathered parameters after forward (saves memory; gathers again for backward)."""
    cpu_offload: bool = False
    """Keep sharded parameters and optimizer state in host memory (CUDA only)."""
    block_types: list[str] = field(factory=list)
    """Class names of the modules to shard individually; empty = the model's _no_split_modules
    (Hugging Face), else the children of every ModuleList."""

    @hookimpl(trylast=True)
    def configure_model(self, run: Run) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        from coretrain import UserError

        if hasattr(run.model, "no_sync"):
            raise UserError(
                "plugins.fsdp: the model is already wrapped for data parallelism (ddp); "
                'enable one of them, e.g. distributed.strategy = "fsdp" and no [plugins.ddp]'
            )
        if self.cpu_offload and run.device.type != "cuda":
            raise UserError("plugins.fsdp.cpu_offload: only meaningful on CUDA; the run is on CPU")
        mesh = run.device_mesh()["dp"]  # with tensor parallelism: 2-D, the "tp" splits kept inside
        offload = CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()
        for block in blocks_of(run.model, self.block_types):
            fully_shard(block, mesh=mesh, reshard_after_forward=self.reshard_after_forward, offload_policy=offload)
        fully_shard(run.model, mesh=mesh, reshard_after_forward=self.reshard_after_forward, offload_policy=offload)
