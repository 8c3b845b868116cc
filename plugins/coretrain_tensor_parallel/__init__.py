"""``tensor-parallel``: split each layer of the model over ``distributed.tp_size`` ranks
(Megatron-style tensor parallelism with PyTorch's DTensor ``parallelize_module``).

    [distributed]
    tp_size = 2          # data parallel = ranks / 2; with more than one replica, FSDP2 shards
                         # over the "dp" dimension of the same 2-D mesh (torchtitan's layout)

The plan — which module is split column-wise, which row-wise, where sequence parallelism
runs — comes from the model provider's ``tensor_parallel_plan`` hook (the ``gpt`` plugin
has one), or from this plugin's ``plan`` option for a model whose provider has none::

    [plugins.tensor-parallel]
    plan = { "layers.*.fc1" = "colwise", "layers.*.fc2" = "rowwise", "head" = "colwise_replicate" }

Parameters the plan leaves out are replicated over the group as DTensors, so every parameter
lives on the same mesh (gradient clipping, optimizers and DCP checkpoints see one kind);
those modules must see the same input on every rank of the group, which holds outside
sequence-parallel regions. Weights tied before splitting (an output head sharing the
embedding) are tied again after.
"""

from __future__ import annotations

import logging
from fnmatch import fnmatch
from typing import Any, cast

from attrs import define, field

from coretrain import FieldValueError, Run, UserError, hookimpl
from coretrain_tensor_parallel.hookspecs import TensorParallelSpecs

STYLES = {
    "colwise": "split output features; output stays split (feeds a rowwise layer)",
    "rowwise": "split input features; output summed over the group",
    "colwise_replicate": "split output features, then gathered (a head whose output is used whole)",
    "embedding": "split the vocabulary of an nn.Embedding; output summed over the group",
}


def _known_styles(instance: object, attribute: Any, value: dict[str, str]) -> None:
    for path, style in value.items():
        if style not in STYLES:
            raise FieldValueError(f"{attribute.name}.{path}", f"unknown style {style!r}; one of: {', '.join(STYLES)}")


def style_of(name: str) -> Any:
    """The ParallelStyle a ``plan`` option's word stands for."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name == "colwise_replicate":
        return ColwiseParallel(output_layouts=Replicate())
    return RowwiseParallel(input_layouts=Replicate())  # embedding


def forget_earlier_redistributions() -> None:
    """Empty DTensor's process-wide cache of redistribution plans before a run splits its model
    (the sharding plans the core empties at every run's end). On torch 2.10 a split embedding of
    an earlier run in this process (an in-process restart, the Python API) is found there as this
    run's, with its mask not this run's, and the first forward stops on torch's
    ``assert self.mask_buffer.data is not None``."""
    from torch.distributed.tensor import _redistribute

    _redistribute._gen_transform_infos.cache_clear()


def sum_partial_gradients(model: Any) -> None:
    """Make each gradient still partial over the group (a sum each rank holds a part of: a
    replicated bias after a rowwise layer, a norm's weight under sequence parallelism) whole.
    torch 2.10 and later do this inside the gradient norm; torch 2.9 takes the norm of each
    rank's part and adds the norms, so clipping used a wrong norm (by half with split experts)."""
    from torch.distributed.tensor import DTensor, Replicate

    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and any(placement.is_partial() for placement in grad.placements):
            param.grad = grad.redistribute(placements=[Replicate() if p.is_partial() else p for p in grad.placements])


def unmatched(model: Any, plan: dict[str, Any]) -> list[str]:
    """The plan's keys that name no module (``parallelize_module`` would only warn and go on)."""
    paths = [name.split(".") for name, _ in model.named_modules() if name]
    return [
        key
        for key in plan
        if key and not any(len(p) == len(key.split(".")) and all(map(fnmatch, p, key.split("."))) for p in paths)
    ]


def tied_parameters(model: Any) -> list[list[tuple[Any, str]]]:
    """Groups of (module, attribute) holding one shared parameter."""
    owners: dict[int, list[tuple[Any, str]]] = {}
    for module in model.modules():
        for attr, param in module._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((module, attr))
    return [group for group in owners.values() if len(group) > 1]


def replicate_rest(model: Any, mesh: Any) -> list[str]:
    """Make every parameter the plan did not split a Replicate DTensor of the group, with its
    module's plain inputs and outputs converted at the boundary; the modules' names."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    def to_dtensor(_module: Any, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def to_local(_module: Any, _inputs: Any, output: Any) -> Any:
        return output.to_local() if isinstance(output, DTensor) else output

    replicated = []
    for name, module in model.named_modules():
        plain = {k: p for k, p in module._parameters.items() if p is not None and not isinstance(p, DTensor)}
        if not plain:
            continue
        for attr, param in plain.items():
            module._parameters[attr] = torch.nn.Parameter(
                distribute_tensor(param.data, mesh, [Replicate()]), requires_grad=param.requires_grad
            )
        for attr, buffer in module._buffers.items():
            if buffer is not None and not isinstance(buffer, DTensor):
                module._buffers[attr] = distribute_tensor(buffer, mesh, [Replicate()])
        module.register_forward_pre_hook(to_dtensor)
        module.register_forward_hook(to_local)
        replicated.append(name or "(root)")
    return replicated


def tie_again(groups: list[list[tuple[Any, str]]]) -> None:
    """Point every holder of a formerly shared parameter at the first holder's (split) one."""
    for (first, first_attr), *others in groups:
        param = getattr(first, first_attr)
        for module, attr in others:
            mine = getattr(module, attr)
            if getattr(mine, "placements", None) != getattr(param, "placements", None):
                raise UserError(
                    f"plugins.tensor-parallel: tied weights {type(first).__name__}.{first_attr} and "
                    f"{type(module).__name__}.{attr} are split differently ({param.placements} vs "
                    f"{mine.placements}); give both the same style (e.g. embedding and colwise)"
                )
            setattr(module, attr, param)


@define(kw_only=True)
class TensorParallel:
    """Tensor parallelism over the "tp" dimension of the run's device mesh."""

    plan: dict[str, str] = field(factory=dict, validator=_known_styles)
    """Module path (``*`` matches one part) -> colwise | rowwise | colwise_replicate | embedding;
    empty = the model provider's own plan."""
    _sums_partial_gradients: bool = field(default=False, init=False, repr=False)
    """torch 2.9: make partial gradients whole before each update (:func:`sum_partial_gradients`)."""

    @hookimpl(tryfirst=True)
    def configure_model(self, run: Run) -> None:
        import torch
        from torch.distributed.tensor.parallel import parallelize_module
        from torch.torch_version import TorchVersion

        tp = run.dist.tp_size
        if tp == 1:
            raise UserError(
                "plugins.tensor-parallel: distributed.tp_size is 1, so there is nothing to split; "
                "set distributed.tp_size = 2 (or more), or remove [plugins.tensor-parallel]"
            )
        model = run.model
        plan = (
            {path: style_of(style) for path, style in self.plan.items()}
            if self.plan
            else cast(TensorParallelSpecs, run.plugins.calls.hook).tensor_parallel_plan(run=run, model=model)
        )
        if not plan:
            linears = [n for n, m in model.named_modules() if type(m).__name__ == "Linear"][:6]
            raise UserError(
                f"plugins.tensor-parallel: model.provider '{run.config.model.provider}' gives no "
                f"tensor-parallel plan; give one, e.g. [plugins.tensor-parallel] plan = "
                f'{{ "{linears[0] if linears else "layers.*.fc1"}" = "colwise", ... }} '
                f"(Linear modules: {', '.join(linears) or 'none'})"
            )
        missing = unmatched(model, plan)
        if missing:
            top = ", ".join(name for name, _ in model.named_children())
            raise UserError(
                f"plugins.tensor-parallel: plan key(s) {', '.join(missing)} match no module of the "
                f"model (its top-level modules: {top})"
            )
        mesh = run.device_mesh()["tp"]
        ties = tied_parameters(model)
        forget_earlier_redistributions()
        parallelize_module(model, mesh, plan)
        replicated = replicate_rest(model, mesh)
        tie_again(ties)
        self._sums_partial_gradients = TorchVersion(torch.__version__) < "2.10"
        if run.dist.is_main:
            logging.getLogger("coretrain").info(
                "tensor-parallel: %d ranks per group split %d plan entries; data parallel over %d; "
                "replicated in each group: %s",
                tp,
                len(plan),
                run.dist.dp_size,
                ", ".join(replicated) or "nothing",
            )

    @hookimpl
    def before_update(self, run: Run) -> None:
        if self._sums_partial_gradients:
            sum_partial_gradients(run.model)
