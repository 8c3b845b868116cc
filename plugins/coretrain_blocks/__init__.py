"""The repeated blocks of a model (a transformer's layers): what FSDP shards one by one and
activation checkpointing recomputes, found one way for every plugin that needs them. A library
of coretrain-plugins (the core never needs it); formerly ``coretrain.blocks_of``, which still
finds it here, with a deprecation warning."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def blocks_of(model: torch.nn.Module, block_types: Sequence[str] = ()) -> list[torch.nn.Module]:
    """Instances of ``block_types`` (class names); by default the model's own ``_no_split_modules``
    (Hugging Face models name their decoder layers there), else every child of the outermost
    ``nn.ModuleList``s (a transformer's layer stack, as the ``gpt`` provider's; a list inside a
    layer, such as a mixture's experts, is part of its layer)."""
    names = set(block_types) or {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
    if names:  # (FSDP2 makes a sharded block an instance of a subclass, FSDPBlock: its bases count)
        return [m for m in model.modules() if any(cls.__name__ in names for cls in type(m).__mro__)]
    blocks: list[torch.nn.Module] = []
    for module in model.modules():  # outer modules first
        if isinstance(module, torch.nn.ModuleList) and not any(module in block.modules() for block in blocks):
            blocks.extend(module)
    return blocks
