"""``gpt``: a GPT model provider (nanoGPT-sized options).

    [model]
    provider = "gpt"
    [model.options]
    n_layer = 4
    n_head = 4
    n_embd = 128

``vocab_size`` and ``block_size`` default to the dataset's vocab size and sequence length.

A mixture of experts (Megatron-Core's router and losses, :mod:`coretrain_gpt.moe`) in place of
every block's MLP::

    n_experts = 8
    moe_top_k = 2
    moe_aux_loss_coeff = 1e-2     # load balancing
    moe_z_loss_coeff = 1e-3       # router z-loss
    moe_capacity_factor = 1.25    # unset: dropless
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attrs import define, field
from coretrain_tokenizer import padded_vocab

from coretrain import FieldValueError, Run, fraction, hookimpl, non_negative, positive

if TYPE_CHECKING:
    import torch


@define(kw_only=True)
class GPTProvider:
    """A readable GPT language model (pre-norm, tied embeddings, fused attention)."""

    n_layer: int = field(default=4, validator=positive)
    """Transformer blocks."""
    n_head: int = field(default=4, validator=positive)
    """Attention heads per block; must divide n_embd."""
    n_embd: int = field(default=128, validator=positive)
    """Model width."""
    vocab_size: int | None = field(default=None, validator=positive)
    """Token vocabulary; unset = the dataset's vocab_size (padded by make_vocab_size_divisible_by)."""
    make_vocab_size_divisible_by: int | None = field(default=None, validator=positive)
    """The dataset's vocabulary padded up to a multiple of this × tp_size, as Megatron pads the
    tokenizer's (128 there: an equal, aligned slice of the embedding per rank); unset: as it is."""
    block_size: int | None = field(default=None, validator=positive)
    """Longest sequence; unset = the dataset's seq_length."""
    dropout: float = field(default=0.0, validator=fraction)
    """Dropout on attention, residual and embeddings."""
    bias: bool = False
    """Biases in Linear and LayerNorm layers (GPT-2 style)."""
    n_experts: int = field(default=0, validator=non_negative)
    """Routed experts in each block's MLP (a mixture of experts); 0 = a dense MLP."""
    moe_top_k: int = field(default=2, validator=positive)
    """Experts each token is routed to (Megatron's moe_router_topk)."""
    moe_capacity_factor: float | None = field(default=None, validator=positive)
    """Assignments an expert takes at most, as a multiple of an even share; unset = dropless."""
    moe_aux_loss_coeff: float = field(default=0.0, validator=non_negative)
    """Weight of the load-balancing loss (Megatron's moe_aux_loss_coeff; 1e-2 is common)."""
    moe_z_loss_coeff: float = field(default=0.0, validator=non_negative)
    """Weight of the router z-loss (Megatron's moe_z_loss_coeff; 1e-3 is common)."""
    moe_shared_experts: int = field(default=0, validator=non_negative)
    """Experts' width of a dense MLP every token also passes through (shared experts); 0 = none."""

    def __attrs_post_init__(self) -> None:
        if self.n_experts == 1 or (self.n_experts and self.moe_top_k > self.n_experts):
            raise FieldValueError(
                "n_experts" if self.n_experts == 1 else "moe_top_k",
                f"a token is routed to moe_top_k ({self.moe_top_k}) of n_experts ({self.n_experts}) experts: "
                "set n_experts to at least 2 and moe_top_k to at most n_experts (or n_experts = 0 for a dense MLP)",
            )
        if self.n_embd % self.n_head:
            fits = next(h for h in range(self.n_head, 0, -1) if self.n_embd % h == 0)
            raise FieldValueError(
                "n_head", f"must divide n_embd ({self.n_embd}), got {self.n_head}; try n_head = {fits}"
            )

    @hookimpl
    def provide_model(self, run: Run) -> Any:
        from coretrain import UserError
        from coretrain_gpt.model import GPT, GPTConfig
        from coretrain_gpt.moe import MoEConfig

        datasets = run.datasets
        vocab_size = self.vocab_size or (datasets.vocab_size if datasets else None)
        if vocab_size and not self.vocab_size:
            vocab_size = padded_vocab(vocab_size, self.make_vocab_size_divisible_by, run.dist.tp_size)
        block_size = self.block_size or (datasets.seq_length if datasets else None)
        if not vocab_size or not block_size:
            raise UserError(
                "model.options: the dataset does not say its vocab_size / seq_length; "
                "set model.options.vocab_size and model.options.block_size"
            )
        return GPT(
            GPTConfig(
                vocab_size=vocab_size,
                block_size=block_size,
                n_layer=self.n_layer,
                n_head=self.n_head,
                n_embd=self.n_embd,
                dropout=self.dropout,
                bias=self.bias,
                moe=self._experts(MoEConfig),
            )
        )

    def _experts(self, config: Any) -> Any:
        """The mixture-of-experts settings, or None for a dense MLP."""
        if not self.n_experts:
            return None
        return config(
            n_experts=self.n_experts,
            top_k=self.moe_top_k,
            capacity_factor=self.moe_capacity_factor,
            aux_loss_coeff=self.moe_aux_loss_coeff,
            z_loss_coeff=self.moe_z_loss_coeff,
            shared_experts=self.moe_shared_experts,
        )

    @hookimpl
    def export_model(self, state: dict[str, torch.Tensor], export_format: str, to: Path) -> str | None:
        """``--format hf``: a transformers GPT-2 directory (:mod:`coretrain_gpt.hf_export`)."""
        if export_format != "hf":
            return None
        from coretrain_gpt.hf_export import save_gpt2

        return save_gpt2(state, self.n_head, to)

    @hookimpl
    def pipeline_blocks(self) -> int:
        """Its blocks, for a pipeline's split (checked before any rank starts)."""
        return self.n_layer

    @hookimpl
    def check_layout(self, config: Any) -> None:
        """What this model's options make impossible on the layout (said once for a job, before
        its ranks start): more tensor-parallel ranks than heads divide, experts that cannot be
        spread over the expert-parallel ranks."""
        from coretrain import UserError

        layout = config.distributed
        if layout.tp_size > 1 and self.n_head % layout.tp_size:
            raise UserError(
                f"distributed.tp_size ({layout.tp_size}) must divide model.options.n_head ({self.n_head}): "
                "each rank takes an equal share of the heads"
            )
        if layout.ep_size > 1 and not self.n_experts:
            raise UserError(
                f"distributed.ep_size ({layout.ep_size}): the model has no experts to spread "
                "(set model.options.n_experts)"
            )
        if layout.ep_size > 1 and self.n_experts % layout.ep_size:
            raise UserError(
                f"distributed.ep_size ({layout.ep_size}) must divide model.options.n_experts ({self.n_experts})"
            )

    @hookimpl
    def configure_model(self, run: Run) -> None:
        """Sequences split over context-parallel ranks: each mixture-of-experts layer routes its
        share, with the routing statistics of the whole sequences."""
        if run.dist.cp_size == 1 or not self.n_experts:
            return
        from coretrain_gpt.moe import MoE, SequenceSplit

        split = SequenceSplit(run.device_mesh()["cp"].get_group(), getattr(run.unwrapped_model, "positions", None))
        for layer in run.unwrapped_model.modules():
            if isinstance(layer, MoE):
                layer.sequence_split = split

    @hookimpl
    def tensor_parallel_plan(self, run: Run, model: Any) -> dict[str, Any] | None:
        """torchtitan's plan, for this model (:mod:`coretrain_gpt.tensor_plan`), its experts
        split as Megatron's expert tensor parallelism splits them."""
        from coretrain import UserError
        from coretrain_gpt.model import GPT, GPTStage
        from coretrain_gpt.tensor_plan import tensor_parallel_plan

        if not isinstance(model, (GPT, GPTStage)):
            return None
        tp, cfg = run.dist.tp_size, model.cfg
        seq_length = run.datasets.seq_length or cfg.block_size
        for what, size in (("model.options.n_head", cfg.n_head), ("the sequence length", seq_length)):
            if size % tp:
                raise UserError(
                    f"distributed.tp_size ({tp}) must divide {what} ({size}): each rank takes an equal share"
                )
        return tensor_parallel_plan(model, cfg.moe is not None, run.dist.ep_size > 1)

    @hookimpl
    def expert_layers(self, model: Any) -> list[Any] | None:
        """The experts of each block's mixture (``n_experts``), for expert parallelism: in the
        whole model or in the pipeline stages a rank holds."""
        from coretrain_gpt.moe import Experts

        return [module for module in model.modules() if isinstance(module, Experts)] or None

    @hookimpl
    def pipeline_split(self, run: Run, model: Any) -> dict[str, Any] | None:
        """Stages by block: embeddings on the first, final norm, head and loss on the last; the
        head's weight is the embedding's (tied), so the two stages holding them sum its gradient.
        A mixture of experts' routers add their losses in their stage (Megatron's
        MoEAuxLossAutoScaler), and each stage's share of the logged values is summed over them."""
        from coretrain_gpt.model import GPT, GPTStage, SplitPositions

        if not isinstance(model, GPT):
            return None
        positions = SplitPositions()  # (context parallelism's, shared by the stages and the loss)
        split: dict[str, Any] = {
            "layers": model.cfg.n_layer,
            "stage": lambda layers, first, last: GPTStage(model, layers, first, last, positions),
            "loss": positions.loss,
            "tied": [("wte.weight", "lm_head.weight")],
        }
        if model.cfg.moe is not None:  # each stage's routers' losses and loads, summed over the stages
            split["values"] = functools.partial(pipeline_values, n_layer=model.cfg.n_layer)
            split["adds_to_loss"], split["loss_value"] = ["moe_aux_loss", "moe_z_loss"], "lm_loss"
        return split


def pipeline_values(stage: Any, micro_batches: int, n_layer: int) -> dict[str, Any]:
    """This rank's stages' share of a mixture of experts' logged values (``pipeline_split``'s
    ``values``): its layers' routers' losses and loads over the step's micro-batches."""
    from coretrain_gpt.model import GPTStage
    from coretrain_gpt.moe import stage_values

    parts = [part for part in stage.modules() if isinstance(part, GPTStage)]
    layers = {index: layer for part in parts for index, layer in part.moe_layers().items()}
    return stage_values(layers, n_layer, next(stage.parameters()).device, micro_batches)
