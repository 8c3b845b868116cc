"""The hook the ``tensor-parallel`` plugin asks model providers (its ``coretrain.hookspecs``
entry point): the contract between two plugins lives with the plugin that calls it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from coretrain import hookspec

if TYPE_CHECKING:
    import torch

    from coretrain import Run


class TensorParallelSpecs(Protocol):
    """Hooks for model providers that tensor parallelism can split."""

    @hookspec(firstresult=True)
    def tensor_parallel_plan(self, run: Run, model: torch.nn.Module) -> dict[str, Any] | None:
        """How to split ``model`` over a tensor-parallel group (hook API 1.2; a spec of coretrain-plugins since 1.10).

        Args: ``run`` — ``run.dist.tp_size`` ranks split each layer; ``model`` — the module
        ``provide_model`` returned (before any wrapper).
        May change: nothing.
        Returns: module path -> ``torch.distributed.tensor.parallel.ParallelStyle``, as
        ``parallelize_module`` takes it (``*`` matches one path part, e.g. ``"blocks.*.mlp.fc"``),
        or None when this plugin does not know the model; the first answer wins. The model provider
        answers for its own model (the ``gpt`` plugin: column/row-wise attention and MLP, sequence
        parallel norms). Raise :class:`coretrain.UserError` when the model cannot be split that way
        (e.g. heads not divisible by the TP degree).
        Ranks: every rank, once, during ``configure_model``; every rank returns the same plan.
        """
