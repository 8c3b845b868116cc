"""The hook the ``expert-parallel`` plugin asks model providers (its ``coretrain.hookspecs``
entry point): which of their model's modules are a mixture of experts' experts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from coretrain import hookspec

if TYPE_CHECKING:
    import torch

    from coretrain import Run


class ExpertSpecs(Protocol):
    """Hooks for model providers whose mixtures of experts expert parallelism can spread."""

    @hookspec(firstresult=True)
    def expert_layers(self, run: Run, model: torch.nn.Module) -> list[Any] | None:
        """The modules holding each mixture-of-experts layer's experts (a spec of
        coretrain-plugins since hook API 1.15), as ``pipeline_split`` is for pipelines.

        Args: ``run`` — ``run.config.distributed.ep_size`` ranks per expert group; ``model`` — the
        module ``provide_model`` returned (before any wrapper).
        May change: nothing yet; the plugin then replaces each module's parameters by its ranks'
        slices and sets its ``dispatch``.
        Returns: None when this plugin does not know the model, else one module per layer, each
        with ``n_experts`` (the same in every layer); its parameters stacked expert first;
        ``expert_rows(rows, expert)`` — each row through the expert of that index among those
        this rank holds; ``dispatch`` — None (compute every expert here) until the plugin sets
        it to the callable ``dispatch(experts, tokens, kept, weights)`` the layer's forward hands
        its routing to (token × expert masks and weights) for the summed outputs; and, for tensor
        parallelism too, ``TENSOR_SPLIT`` (parameter name -> the dimension the tensor-parallel
        ranks split, or None). The gpt provider answers for its ``n_experts`` models, the hf
        provider for transformers' stacked experts (Mixtral, Qwen-MoE, DeepSeek-V3).
        Ranks: every rank, once, during ``configure_model``.
        """
