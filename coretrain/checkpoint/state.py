"""What a checkpoint holds, collected from the run: per-rank state, model, optimizer, manifest."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import numpy as np
import torch

from coretrain.checkpoint.layout import MANIFEST, MANIFEST_FORMAT
from coretrain.configload import config_as_dict
from coretrain.run import Run

T = TypeVar("T")


def rng_state() -> dict[str, Any]:
    """Every generator a run may draw from, as plain lists and tensors (weights_only-safe)."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, cached],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def keeping_rng(hook: Callable[..., T]) -> Callable[..., T]:
    """``hook``, called so that it leaves the run's random streams as it found them.

    A plugin's host-side work (an import that draws a random id, as rich's does, a logger's
    start-up, an evaluation) happens at other steps in a resumed run than in an uninterrupted
    one: were it to draw from the streams training draws from (dropout), a resume would train
    on other numbers from then on. Costs a copy of the streams' state per call (microseconds),
    so it wraps the hooks called at start, per log interval, per evaluation and per save."""

    @functools.wraps(hook)
    def call(**kwargs: Any) -> T:
        saved = rng_state()
        try:
            return hook(**kwargs)
        finally:
            set_rng_state(saved)

    return call


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back the streams :func:`rng_state` took (a checkpoint's, or a peer's: ``torchft`` heals with them)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@attrs.define
class ShardedState:
    """Model + optimizer state of a sharded (FSDP2) model: saved collectively with DCP."""

    state: dict[str, Any]
    writers: int = 1
    """Threads (and files) per rank: ``checkpoint.storage_writers_per_rank``."""


def is_sharded(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "full_tensor") for p in model.parameters())  # DTensor parameters


def collect(run: Run, extra_state: dict[str, Any], evaluated: list[str] | None = None) -> dict[str, Any]:
    """This rank's files of the checkpoint: file name -> object to save."""
    state = {
        "train": attrs.asdict(run.state),  # step, consumed_samples, skipped_updates
        "scheduler": run.scheduler.state_dict(),
        "rng": rng_state(),
        **extra_state,
    }
    if run.grad_scaler is not None:
        state["grad_scaler"] = run.grad_scaler.state_dict()
    files: dict[str, Any] = {f"rank_{run.dist.rank:05d}.pt": state}
    sharded = is_sharded(run.model)
    checkpoint = run.config.checkpoint
    if sharded:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(run.model, run.optimizer, options=dcp_options(checkpoint.save_frozen))
        files["sharded"] = ShardedState({"model": model, "optimizer": optimizer}, checkpoint.storage_writers_per_rank)
    elif run.dist.is_main:
        model_state = run.unwrapped_model.state_dict()
        if not checkpoint.save_frozen:
            frozen = frozen_names(run.unwrapped_model)
            model_state = {name: value for name, value in model_state.items() if name not in frozen}
        files["model.pt"] = model_state
        files["optimizer.pt"] = run.optimizer.state_dict()
    if run.dist.is_main:
        files[MANIFEST] = manifest(run, "sharded" if sharded else "replicated", evaluated or [])
    return files


def frozen_names(model: torch.nn.Module) -> set[str]:
    """State-dict names of the parameters that do not train (tied names included)."""
    return {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def dcp_options(with_frozen: bool, flat: bool = True, strict: bool = True) -> Any:
    """torch.distributed.checkpoint's state-dict options: frozen parameters in or out (out, a load
    leaves them as the model was built — LoRA's base from its path — and is not strict about
    them: every other key is read, and DCP refuses one the checkpoint lacks); the optimizer's
    parameter groups ``flat``, one entry per parameter (as torchtitan saves them), so that ranks
    holding other parameters — pipeline stages — each save their own groups; not ``strict``, a
    load may leave other parameters as they are too (``checkpoint.pretrained_exclude``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(
        ignore_frozen_params=not with_frozen, flatten_optimizer_state_dict=flat, strict=strict and with_frozen
    )


def manifest(run: Run, layout: str, evaluated: list[str]) -> dict[str, Any]:
    """What rank 0 records about a checkpoint, in plain JSON (read before any tensor file)."""
    from coretrain.version import __version__

    return {
        "format": MANIFEST_FORMAT,
        "coretrain": __version__,
        "step": run.state.step,
        "layout": layout,
        "frozen_saved": run.config.checkpoint.save_frozen,
        "world_size": run.dist.world_size,
        "optimizer": run.config.optimizer.name,
        "seq_length": run.datasets.seq_length,
        "evaluated": evaluated,
        "config": config_as_dict(run.config),
    }
