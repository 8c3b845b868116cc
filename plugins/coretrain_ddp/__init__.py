"""``ddp``: data parallelism with torch's DistributedDataParallel.

Enabled by ``distributed.strategy = "ddp"`` (the default when torchrun starts more than one
rank) or a ``[plugins.ddp]`` table. Wraps the model last (``trylast``), after numerics
and compilation plugins have changed it. Gradients are averaged over ranks during backward;
the loop skips the all-reduce on all but the last micro-batch (``no_sync``).

Megatron's DistributedDataParallelConfig knobs, by its names, where torch's DDP has them:
``bucket_size`` (gradient elements per bucket, 4 bytes each: ``bucket_cap_mb``),
``overlap_grad_reduce`` (false: one bucket for every gradient, reduced once backward ends —
Megatron's default; here true, torch's), ``grad_reduce_in_fp32`` (low-precision gradients,
``master-weights``' bf16, all-reduced in fp32 by a comm hook, then cast back) and
``average_in_collective`` (average with the collective's AVG instead of dividing first; NCCL
has it, gloo does not: one error).

``use_distributed_optimizer`` is Megatron's distributed optimizer as ZeRO-1, with torch's
``ZeroRedundancyOptimizer``: each rank keeps the optimizer state of its share of the
parameters and updates only those, then broadcasts them, so the parameters stay replicated
(DDP's all-reduce unchanged) and the state costs 1/N per rank. Its checkpoints are the
replicated kind: the state is gathered to rank 0 when saving (``on_checkpoint``, every rank)
and resumes anywhere, on any number of ranks, with or without it.
"""

from __future__ import annotations

import inspect
import logging
import re
from typing import Any

import torch
from attrs import define, field

from coretrain import FieldValueError, Run, UserError, hookimpl, max_over_ranks, positive

log = logging.getLogger("coretrain")


def _no_overlapped_gather(plugin: Any, attribute: Any, value: bool) -> None:
    if value:
        raise FieldValueError(
            attribute.name,
            "torch's ZeroRedundancyOptimizer broadcasts the updated parameters after the step, not overlapped "
            'with the next forward; distributed.strategy = "fsdp" gathers parameters overlapped with compute',
        )


@define(kw_only=True)
class DDP:
    """DistributedDataParallel: replicate the model, average gradients over ranks."""

    bucket_cap_mb: float = 25.0
    """Gradient bucket size for overlapping all-reduce with backward."""
    find_unused_parameters: bool = False
    """Needed only when some parameters get no gradient in a step (costs a graph walk)."""
    gradient_as_bucket_view: bool = True
    """Let gradients alias the communication buckets (saves one copy of the gradients)."""
    static_graph: bool = False
    """Promise the autograd graph is the same every step (enables more overlap)."""
    bucket_size: int | None = field(default=None, validator=positive)
    """Megatron's: gradient elements per bucket (sets bucket_cap_mb at 4 bytes per element)."""
    overlap_grad_reduce: bool = True
    """Megatron's: reduce buckets while backward runs; false: one bucket, reduced at its end."""
    grad_reduce_in_fp32: bool = False
    """Megatron's: all-reduce bf16/fp16 gradients in fp32 (fp32 gradients already are)."""
    average_in_collective: bool = False
    """Megatron's: average in the all-reduce (ReduceOp.AVG, NCCL) instead of dividing before it."""
    use_distributed_optimizer: bool = False
    """Megatron's: ZeRO-1 — the optimizer state sharded over the ranks, parameters replicated."""
    overlap_param_gather: bool = field(default=False, validator=_no_overlapped_gather)
    """Megatron's; not here: ZeRO-1 broadcasts the updated parameters after the step."""
    _said: bool = field(default=False, init=False, repr=False)
    _said_buckets: bool = field(default=False, init=False, repr=False)

    def _bucket_cap_mb(self, run: Run) -> float:
        if not self.overlap_grad_reduce:  # one bucket holds every gradient: reduced when backward ends
            return 2 * sum(p.numel() * p.element_size() for p in run.model.parameters()) / 2**20 + 1
        return self.bucket_size * 4 / 2**20 if self.bucket_size else self.bucket_cap_mb

    @hookimpl(trylast=True)
    def configure_model(self, run: Run) -> None:
        if run.dist.tp_size > 1:
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
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        if self.average_in_collective and dist.get_backend() == "gloo":
            raise UserError(
                "plugins.ddp.average_in_collective: gloo has no averaging all-reduce (ReduceOp.AVG); "
                "drop it on gloo (the gradients are divided before the sum instead), or use nccl"
            )
        run.model = DistributedDataParallel(
            run.model,
            device_ids=[run.device.index] if run.device.type == "cuda" else None,
            bucket_cap_mb=self._bucket_cap_mb(run),
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
        )
        if self.grad_reduce_in_fp32 or self.average_in_collective:
            # a lambda: DDP checks a hook's annotations, which this module's are strings of
            run.model.register_comm_hook(None, lambda state, bucket: self._all_reduce(state, bucket))

    @hookimpl(trylast=True)  # after master-weights, which it refuses to wrap
    def configure_optimizer(self, run: Run) -> None:
        if not self.use_distributed_optimizer or run.dist.world_size == 1:
            return
        from torch.distributed.optim import ZeroRedundancyOptimizer

        plain = run.optimizer
        kind = type(plain)
        if not kind.__module__.startswith("torch.optim"):
            raise UserError(
                f"plugins.ddp.use_distributed_optimizer: the optimizer is {kind.__name__} (a plugin's wrapper), "
                "which torch's ZeroRedundancyOptimizer cannot shard; drop one of them (for bf16 weights with "
                'sharded state, use distributed.strategy = "fsdp" with [plugins.fsdp] param_dtype = "bfloat16")'
            )
        # the groups as they are, but for torch's param_names, which ZeRO's partitions do not keep
        groups = [{key: value for key, value in group.items() if key != "param_names"} for group in plain.param_groups]
        accepted = inspect.signature(kind).parameters  # defaults may hold what the class sets itself
        defaults = {key: value for key, value in plain.defaults.items() if key in accepted}
        run.optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=kind, **defaults)
        if run.dist.is_main:
            log.info(
                "ddp: distributed optimizer (ZeRO-1): each of %d ranks holds its share of the state",
                run.dist.world_size,
            )

    @hookimpl
    def explain_failure(self, run: Run, error: BaseException) -> str | None:
        """DDP's error for a parameter that got no gradient names DDP's constructor argument, which
        a user of this plugin never calls, and the parameters by their index: say it with this
        plugin's key and the parameters' names."""
        if "Expected to have finished reduction in the prior iteration" not in str(error):
            return None
        unused = unused_parameters(run.unwrapped_model, str(error))
        step = run.state.step
        if unused:
            shown = ", ".join(unused[:4]) + (f" and {len(unused) - 4} more" if len(unused) > 4 else "")
            which, more = f"the model's parameters {shown} got no gradient in step {step}", ""
        else:
            which = f"a parameter of the model got no gradient in step {step}"
            more = "; TORCH_DISTRIBUTED_DEBUG=DETAIL names them"
        return (
            f"{which} (DDP reduces every parameter's gradient each step): set [plugins.ddp] "
            "find_unused_parameters = true (a walk of the autograd graph each step), or freeze the parameters "
            f"the loss does not use (requires_grad = False){more}"
        )

    @hookimpl
    def on_checkpoint(self, run: Run) -> None:
        """Every rank, before rank 0 reads the optimizer state: gather the shards to it."""
        consolidate = getattr(run.optimizer, "consolidate_state_dict", None)
        if consolidate is not None:
            consolidate(to=0)

    @hookimpl
    def on_log(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        if not self._said_buckets and step > 2 and run.dist.is_main and hasattr(run.model, "_get_ddp_logging_data"):
            self._said_buckets = True  # DDP rebuilds its buckets in the order gradients come, in step 2
            logged: Any = run.model._get_ddp_logging_data  # torch's own record of the buckets it built
            data = logged()
            sizes = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")).split(", ")
            log.info("ddp: gradients all-reduced in %d bucket(s) of %s bytes", len(sizes), ", ".join(sizes))
        if self.use_distributed_optimizer:  # the state this rank holds, the largest over ranks
            local = getattr(run.optimizer, "optim", run.optimizer)  # ZeRO's: this rank's partition
            held = sum(
                v.numel() * v.element_size() for s in local.state.values() for v in s.values() if torch.is_tensor(v)
            )
            metrics["optimizer_state_bytes_max"] = float(max_over_ranks(held)[0])

    def _all_reduce(self, state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """DDP's all-reduce of one bucket, in fp32 with ``grad_reduce_in_fp32``, averaged by
        the collective with ``average_in_collective``; the result in the bucket's own dtype."""
        import torch.distributed as dist

        buffer = bucket.buffer()
        upcast = self.grad_reduce_in_fp32 and buffer.dtype in (torch.bfloat16, torch.float16)
        reduced = buffer.float() if upcast else buffer
        if upcast and not self._said:
            self._said = True
            log.info("ddp: %s gradients all-reduced in float32 (grad_reduce_in_fp32)", str(buffer.dtype).split(".")[1])
        if self.average_in_collective:
            work = dist.all_reduce(reduced, op=dist.ReduceOp.AVG, async_op=True)
        else:
            reduced.div_(dist.get_world_size())
            work = dist.all_reduce(reduced, async_op=True)

        def into_bucket(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            return buffer.copy_(done.value()[0]) if upcast else done.value()[0]

        future: torch.futures.Future[torch.Tensor] = work.get_future().then(into_bucket)
        return future


def unused_parameters(model: torch.nn.Module, message: str) -> list[str]:
    """The names of the parameters DDP's error lists by index ("Parameter indices which did not
    receive grad for rank 0: 2 3"): indices into the trainable parameters, in the model's order."""
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", message)
    trainable = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    indices = [int(index) for index in found.group(1).split()] if found else []
    return [trainable[index] for index in indices if index < len(trainable)]
