"""``fsdp``: fully sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Shards each transformer block, then the root (torchtitan's recipe), over the data-parallel
dimension of the run's device mesh (all ranks; with ``distributed.tp_size`` > 1, one rank of
each tensor-parallel group, for 2-D parallelism). Parameters become DTensors, so checkpoints are saved sharded with
torch.distributed.checkpoint and can be resumed on a different number of ranks. Mixed precision
is FSDP2's ``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``, ``output_dtype``: the
sharded fp32 parameters stay the optimizer's master copy), offload its ``CPUOffloadPolicy``.
Enable with ``distributed.strategy = "fsdp"`` (options in ``[plugins.fsdp]``).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

import torch
from attrs import define, field
from coretrain_blocks import blocks_of

from coretrain import FieldValueError, Run, hookimpl

log = logging.getLogger("coretrain")


def torch_dtype(name: str | None) -> torch.dtype | None:
    return getattr(torch, name) if name else None


MEGATRON_KNOBS = {
    "bucket_size": (None, "FSDP2 reduce-scatters each sharded block's gradients at once: the unit is block_types"),
    "use_distributed_optimizer": (True, "FSDP2 always shards the optimizer state (and parameters and gradients)"),
    "overlap_grad_reduce": (True, "FSDP2 always reduce-scatters a block's gradients while backward goes on"),
    "overlap_param_gather": (True, "FSDP2 always gathers the next block's parameters while this one computes"),
}
"""Megatron's DDP knobs that FSDP2 answers by design: the value it always has, and why."""


def _fixed_by_fsdp(plugin: Any, attribute: Any, value: Any) -> None:
    """A Megatron knob set against what FSDP2 always does: one error saying what it does."""
    fixed, why = MEGATRON_KNOBS[attribute.name]
    if value is not None and value != fixed:
        hint = ' (strategy = "ddp" has it)' if attribute.name in ("bucket_size", "use_distributed_optimizer") else ""
        raise FieldValueError(attribute.name, f"{why}; it cannot be {json.dumps(value)} here{hint}")


@define(kw_only=True)
class FSDP:
    """FSDP2: shard parameters, gradients and optimizer state over ranks, block by block."""

    reshard_after_forward: bool = True
    """Free gathered parameters after forward (saves memory; gathers again for backward)."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in host memory (FSDP2's CPUOffloadPolicy)."""
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of the gathered parameters forward and backward compute in; unset = as stored.
    The recipe for bf16 training: param_dtype = "bfloat16", reduce_dtype = "float32"."""
    reduce_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype gradients are reduce-scattered in; unset = param_dtype's."""
    output_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of the sharded modules' floating-point outputs; unset = as computed."""
    grad_reduce_in_fp32: bool = False
    """Megatron's name for ``reduce_dtype = "float32"`` (gradients reduce-scattered in fp32)."""
    bucket_size: int | None = field(default=None, validator=_fixed_by_fsdp)
    """Megatron's; FSDP2 has no buckets (a block is the unit): unset only."""
    use_distributed_optimizer: bool | None = field(default=None, validator=_fixed_by_fsdp)
    """Megatron's; FSDP2 always shards the optimizer state: true or unset."""
    overlap_grad_reduce: bool | None = field(default=None, validator=_fixed_by_fsdp)
    """Megatron's; FSDP2 always overlaps its reduce-scatters with backward: true or unset."""
    overlap_param_gather: bool | None = field(default=None, validator=_fixed_by_fsdp)
    """Megatron's DDP knobs, accepted where they say what FSDP2 does anyway (MEGATRON_KNOBS)."""
    block_types: list[str] = field(factory=list)
    """Class names of the modules to shard individually; empty = the model's _no_split_modules
    (Hugging Face), else the children of every ModuleList."""

    def _reduce_dtype(self) -> str | None:
        if not self.grad_reduce_in_fp32:
            return self.reduce_dtype
        if self.reduce_dtype not in (None, "float32"):
            from coretrain import UserError

            raise UserError(
                f"plugins.fsdp: grad_reduce_in_fp32 = true and reduce_dtype = {self.reduce_dtype!r} disagree; "
                'grad_reduce_in_fp32 is Megatron\'s name for reduce_dtype = "float32": keep one'
            )
        return "float32"

    @hookimpl(trylast=True)
    def configure_model(self, run: Run) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        from coretrain import UserError

        if hasattr(run.model, "no_sync"):
            raise UserError(
                "plugins.fsdp: the model is already wrapped for data parallelism (ddp); "
                'enable one of them, e.g. distributed.strategy = "fsdp" and no [plugins.ddp]'
            )
        cuda = run.device.type == "cuda"
        if self.cpu_offload and not cuda and run.dist.is_main:
            log.info("fsdp: cpu_offload on a CPU run keeps the state where it already is (no memory saved)")
        mesh = run.device_mesh()
        hsdp, cp = "dp_replicate" in (mesh.mesh_dim_names or ()), run.dist.cp_size > 1
        if hsdp and run.dist.is_main:
            replicas, shards = mesh["dp_replicate"].size(), mesh["dp_shard"].size()
            log.info("fsdp: HSDP, %d replicas each sharded over %d ranks", replicas, shards)
        options = {
            # HSDP: a 2-D mesh, replicated over the first dim and sharded over the second; with
            # tensor parallelism the "tp" splits stay inside the parameters' DTensors
            "mesh": mesh[("dp_replicate", "dp_shard_cp" if cp else "dp_shard") if hsdp else "dp_cp" if cp else "dp"],
            "reshard_after_forward": self.reshard_after_forward,
            "offload_policy": CPUOffloadPolicy(pin_memory=cuda) if self.cpu_offload else OffloadPolicy(),
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch_dtype(self.param_dtype),
                reduce_dtype=torch_dtype(self._reduce_dtype()),
                output_dtype=torch_dtype(self.output_dtype),
            ),
        }
        # parameters already spread over this mesh (expert parallelism's experts) stay as they are
        if spread := {p for p in run.model.parameters() if getattr(p, "device_mesh", None) == options["mesh"]}:
            options["ignored_params"] = spread
        for part in run.model_parts or [run.model]:  # a pipeline's stages on this rank: a root each
            for block in blocks_of(part, self.block_types):
                fully_shard(block, **options)
            fully_shard(part, **options)
