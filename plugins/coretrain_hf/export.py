"""``coretrain checkpoint export RUN_DIR --format hf --to DIR``: a directory ``from_pretrained`` loads.

The checkpoint holds the wrapper's state dict (keys prefixed ``hf.``); the model's config is the
one the run trained with, saved by the provider in ``RUN_DIR/hf-config/``. The weights are
loaded into a freshly built transformers model (strictly: every key must fit) and written with
its own ``save_pretrained``, so tied weights, sharding and the config come out as transformers
expects. The tokenizer the run's data used is copied alongside.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from coretrain import UserError, require

if TYPE_CHECKING:
    from coretrain_hf import HFModel

CONFIG_DIR = "hf-config"
PREFIX = "hf."


def save_config(model: Any, output_dir: Path) -> None:
    """Record the transformers config the run trains (rank 0, at the start of training)."""
    model.config.save_pretrained(output_dir / CONFIG_DIR)


def save_pretrained(
    provider: HFModel,
    state: dict[str, torch.Tensor],
    config: dict[str, Any],
    run_dir: Path,
    to: Path,
    options: dict[str, Any],
) -> str:
    transformers = require("transformers", needed_by="checkpoint export --format hf", extra="hf")
    from coretrain_hf import DTYPES, TASKS

    if to.exists() and (not to.is_dir() or any(to.iterdir())):
        raise UserError(f"--to: {to} exists and is not an empty directory; name a new one")
    saved = run_dir / CONFIG_DIR
    hf_config = (
        transformers.AutoConfig.from_pretrained(saved, local_files_only=True)
        if (saved / "config.json").is_file()
        else provider.model_config()
    )
    weights = {name.removeprefix(PREFIX): tensor for name, tensor in state.items()}
    auto = getattr(transformers, TASKS[provider.task])
    model = auto.from_config(hf_config, dtype=DTYPES[provider.dtype])
    load_strictly(model, weights)
    what = "model"
    to.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(to)
    copied = copy_tokenizer(config, to)
    return f"wrote {to}: {type(model).__name__} {what}" + (f", tokenizer from {copied}" if copied else "")


def load_strictly(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Every checkpoint tensor goes somewhere and every model tensor is filled (tied ones aside)."""
    result = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise UserError(
            "the checkpoint does not fit the model its run recorded: "
            f"missing {missing[:3]}, unexpected {result.unexpected_keys[:3]}"
        )


def copy_tokenizer(config: dict[str, Any], to: Path) -> str | None:
    """The tokenizer the run's data (or its model directory) used, saved next to the weights."""
    candidates = [
        config.get("data", {}).get("options", {}).get("tokenizer"),
        config.get("model", {}).get("options", {}).get("path"),
    ]
    for candidate in candidates:
        if candidate and (Path(candidate) / "tokenizer_config.json").is_file():
            transformers = require("transformers", needed_by="checkpoint export --format hf", extra="hf")
            transformers.AutoTokenizer.from_pretrained(candidate, local_files_only=True).save_pretrained(to)
            return str(candidate)
    return None
