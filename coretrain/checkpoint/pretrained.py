"""Weights to start from (``checkpoint.pretrained``): a coretrain checkpoint, a file of its
weights, or a file in a format a plugin reads (``read_pretrained``: safetensors, a training
script's ``torch.save``); model weights only, at step 0 with a fresh optimizer."""

from __future__ import annotations

from fnmatch import fnmatchcase
from pathlib import Path

from coretrain.checkpoint import safeload
from coretrain.checkpoint.layout import followed_link, read_manifest
from coretrain.checkpoint.load import load_sharded, load_whole, read_weights
from coretrain.checkpoint.resume import check_model_fits, check_sharded_fits, optional_names, sharded_shapes
from coretrain.errors import CheckpointUnreadable, UserError, did_you_mean
from coretrain.pluginmanager import hook_calls
from coretrain.run import Run

EXCLUDE_HINT = " (checkpoint.pretrained_exclude keeps a new part's own initial weights, e.g. a head for other classes)"


def excluded_names(run: Run, saved_names: set[str]) -> set[str]:
    """The names ``checkpoint.pretrained_exclude`` matches in the model or the checkpoint (a
    module's name matches its parameters); a pattern that matches none is a mistake."""
    names = {*run.unwrapped_model.state_dict(), *saved_names}
    excluded: set[str] = set()
    for pattern in run.config.checkpoint.pretrained_exclude:
        matched = {name for name in names if fnmatchcase(name, pattern) or fnmatchcase(name, pattern + ".*")}
        if not matched:
            modules = {name.rpartition(".")[0] for name in names}
            hint = did_you_mean(pattern, sorted(modules | names)) or f" (such as {', '.join(sorted(names)[:3])})"
            raise UserError(f"checkpoint.pretrained_exclude: {pattern!r} matches no parameter's name{hint}")
        excluded |= matched
    return excluded


def load_pretrained(run: Run, path: str) -> None:
    """Model weights only (fine-tuning): step 0, fresh optimizer."""
    directory = followed_link(Path(path), "checkpoint.pretrained")
    if not directory.exists():
        raise UserError(f"checkpoint.pretrained: '{path}' does not exist")
    calls = hook_calls(run)
    weights = calls.hook.read_pretrained(run=run, path=directory) if calls.implemented("read_pretrained") else None
    info = read_manifest(directory) if directory.is_dir() and weights is None else {}  # (a file has none)
    frozen_saved = info.get("frozen_saved", True)
    if info.get("layout") == "sharded":
        metadata = safeload.check_metadata(directory / "sharded")
        kept = excluded_names(run, set(sharded_shapes(metadata)))
        optional = optional_names(run.unwrapped_model, frozen_saved, kept)
        check_sharded_fits(directory, metadata, run, EXCLUDE_HINT, optional)
        single = run.dist.world_size == 1
        load_sharded(run.model, None, directory / "sharded", frozen_saved, single, metadata, kept=kept)
        return
    if weights is None:  # no plugin's format: a coretrain checkpoint, or torch's own file of its weights
        weights = read_weights(directory) if directory.is_dir() else safeload.load_file(directory)
    if not isinstance(weights, dict):
        raise CheckpointUnreadable(directory, "not a state dict of model weights")
    kept = excluded_names(run, set(weights))
    weights = {name: value for name, value in weights.items() if name not in kept}
    check_model_fits(directory, weights, run, EXCLUDE_HINT, optional_names(run.unwrapped_model, frozen_saved, kept))
    load_whole(run.model, run.unwrapped_model, weights, strict=frozen_saved and not kept)
