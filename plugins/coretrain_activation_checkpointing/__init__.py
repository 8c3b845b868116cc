"""``activation-checkpointing``: keep fewer activations for backward and recompute the rest
(torchtitan's activation checkpointing), block by block.

- ``mode = "full"``: every block keeps only its input; its forward runs again in backward.
- ``mode = "selective"``: the same for every ``every``-th block (blocks 0, N, 2N, …), the
  others keep everything — a dial between memory and time.
- ``mode = "op"``: every block keeps the outputs of its matmuls and attention (all but every
  second matmul, torchtitan's op-level policy) and recomputes the cheap ops between them.

The blocks are :func:`coretrain.blocks_of`'s: ``block_types`` by class name, else the model's
``_no_split_modules`` (a Hugging Face model's decoder layers), else the children of every
``nn.ModuleList`` (the ``gpt`` provider's blocks). Each block's ``forward`` is replaced in place
by a non-reentrant ``torch.utils.checkpoint`` of itself: modules, parameter names and
checkpoints stay as they were, so it composes with FP8 and tensor parallelism (which change
the modules inside a block), compile (which traces the checkpoint) and FSDP2 / DDP (which wrap
the blocks and the model) in any order. The RNG state is restored for the recomputation, so
dropout draws the same masks: losses are those of a run without it.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from attrs import define, field
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from coretrain import Run, UserError, blocks_of, hookimpl, positive

log = logging.getLogger("coretrain")


def _ops(*names: str) -> set[Any]:
    """The aten / c10d ops of these names that this torch has (``namespace.op.overload``)."""
    found = set()
    for name in names:
        namespace, op, overload = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return found


MATMULS = _ops("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default")
KEPT = MATMULS | _ops(
    "aten._scaled_mm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "aten.max.default",
)
"""What the op-level policy keeps: matmul and attention outputs, reduce-scatters (torchtitan's list)."""


def op_level_contexts() -> Any:
    """Selective checkpointing's context for one block call: keep :data:`KEPT` outputs, except
    every second matmul, recompute everything else (counted separately in forward and recompute,
    so both make the same choices)."""
    matmuls: defaultdict[bool, int] = defaultdict(int)

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in MATMULS:
            matmuls[ctx.is_recompute] += 1
            if matmuls[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in KEPT else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)  # type: ignore[no-untyped-call]


def checkpoint_forward(block: torch.nn.Module, preserve_rng_state: bool, op_level: bool) -> None:
    """Replace ``block.forward`` by a checkpoint of itself (module and names unchanged)."""
    inner: Callable[..., Any] = block.forward
    options: dict[str, Any] = {"use_reentrant": False, "preserve_rng_state": preserve_rng_state}
    if op_level:
        options["context_fn"] = op_level_contexts

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, **options, **kwargs)

    block.forward = forward


def apply(
    model: torch.nn.Module, mode: str, every: int = 2, block_types: Sequence[str] = (), preserve_rng_state: bool = True
) -> tuple[list[torch.nn.Module], int]:
    """Checkpoint ``model``'s blocks as ``mode`` says: (the blocks checkpointed, the number of blocks)."""
    blocks = blocks_of(model, block_types)
    chosen = [b for i, b in enumerate(blocks) if mode != "selective" or i % every == 0]
    for block in chosen:
        checkpoint_forward(block, preserve_rng_state, op_level=mode == "op")
    return chosen, len(blocks)


@define(kw_only=True)
class ActivationCheckpointing:
    """Recompute activations in backward instead of keeping them: full, every Nth block, or op-level."""

    mode: Literal["full", "selective", "op"] = "full"
    """full: every block; selective: every `every`-th block; op: keep matmul/attention outputs only."""
    every: int = field(default=2, validator=positive)
    """With mode = "selective": checkpoint blocks 0, every, 2·every, …"""
    block_types: list[str] = field(factory=list)
    """Class names of the blocks; empty = the model's _no_split_modules, else ModuleList children."""
    preserve_rng_state: bool = True
    """Replay the RNG in recomputation (dropout masks as in forward); false is faster with no dropout."""

    @hookimpl
    def configure_model(self, run: Run) -> None:
        chosen, total = apply(run.model, self.mode, self.every, self.block_types, self.preserve_rng_state)
        if not total:
            raise UserError(
                "plugins.activation-checkpointing: found no blocks to checkpoint in "
                f"{type(run.model).__name__}; name their class in block_types"
            )
        if run.dist.is_main:
            kinds = ", ".join(sorted({type(b).__name__ for b in chosen}))
            log.info("activation checkpointing (%s): %d of %d blocks (%s)", self.mode, len(chosen), total, kinds)
