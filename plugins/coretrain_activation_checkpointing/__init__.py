"""``activation-checkpointing``: keep fewer activations for backward and recompute the rest
(torchtitan's activation checkpointing), block by block.

- ``mode = "full"``: every block keeps only its input; its forward runs again in backward.
- ``mode = "selective"``: the same for every ``every``-th block (blocks 0, N, 2N, …), the
  others keep everything — a dial between memory and time.
- ``mode = "op"``: every block keeps the outputs of its matmuls and attention (all but every
  second matmul, torchtitan's op-level policy) and recomputes the cheap ops between them.
- ``mode = "offload"``: nothing recomputed; what every block saves for backward is kept in host
  memory (``torch.autograd.graph.save_on_cpu``, pinned on CUDA) and copied back in backward.
  It composes: ``mode = ["selective", "offload"]`` recomputes every ``every``-th block and
  offloads the others' (with ``full`` or ``op`` the recomputed blocks save little of their own
  to offload: their inputs and, for ``op``, the matmul outputs its cache keeps on the device).

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
from typing import Any

import torch
from attrs import define, field
from coretrain_blocks import blocks_of
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from coretrain import FieldValueError, Run, UserError, hookimpl, positive

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


def offload_forward(block: torch.nn.Module) -> None:
    """Run ``block.forward`` with what it saves for backward kept in host memory."""
    inner: Callable[..., Any] = block.forward
    pin = torch.cuda.is_available()  # pinned memory needs a device to pin for

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=pin):
            return inner(*args, **kwargs)

    block.forward = forward


def apply(
    model: torch.nn.Module,
    mode: str | Sequence[str],
    every: int = 2,
    block_types: Sequence[str] = (),
    preserve_rng_state: bool = True,
) -> tuple[list[torch.nn.Module], int]:
    """Checkpoint and/or offload ``model``'s blocks as ``mode`` says: (the blocks recomputed or
    offloaded, the number of blocks)."""
    modes = {mode} if isinstance(mode, str) else set(mode)
    recompute = next((m for m in ("full", "selective", "op") if m in modes), None)
    blocks = blocks_of(model, block_types)
    chosen = [b for i, b in enumerate(blocks) if recompute and (recompute != "selective" or i % every == 0)]
    for block in chosen:
        checkpoint_forward(block, preserve_rng_state, op_level=recompute == "op")
    if "offload" in modes:
        for block in blocks:
            offload_forward(block)  # outside the checkpoint: what a recomputed block keeps goes too
    return (blocks if "offload" in modes else chosen), len(blocks)


MODES = ("full", "selective", "op", "offload")


def _modes(instance: Any, attribute: Any, value: Any) -> None:
    modes = [value] if isinstance(value, str) else value if isinstance(value, list) else [value]
    recompute = [m for m in modes if m != "offload"]
    if not modes or any(m not in MODES for m in modes) or len(recompute) > 1 or len(set(modes)) < len(modes):
        raise FieldValueError(
            attribute.name,
            f'expected one of {", ".join(MODES)}, or a recomputing mode and "offload" '
            f'(["selective", "offload"]); got {value!r}',
        )


@define(kw_only=True)
class ActivationCheckpointing:
    """Recompute activations in backward instead of keeping them: full, every Nth block, or op-level."""

    mode: Any = field(default="full", validator=_modes)  # a mode, or a list of two (cattrs: no str | list union)
    """full: every block; selective: every `every`-th block; op: keep matmul/attention outputs
    only; offload: keep every block's saved activations in host memory; or a list of one of the
    first three and "offload"."""
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
            mode = self.mode if isinstance(self.mode, str) else " + ".join(self.mode)
            log.info("activation checkpointing (%s): %d of %d blocks (%s)", mode, len(chosen), total, kinds)
