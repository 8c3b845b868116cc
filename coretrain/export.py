"""Look into a run's checkpoints and take the weights out: ``coretrain checkpoint list | export``.

Works on any run directory, without building the run; sharded (FSDP) checkpoints are
gathered into one state dict in this process, through the same restricted readers as resume.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import attrs
import torch

from coretrain import safeload
from coretrain.checkpoint import find_checkpoint, read_manifest, step_dirs
from coretrain.config import Config
from coretrain.configload import structure
from coretrain.errors import CheckpointUnreadable, UserError
from coretrain.pluginmanager import Plugins, load_plugins


@attrs.define(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    complete: bool
    size_bytes: int


def list_checkpoints(run_dir: Path) -> list[CheckpointInfo]:
    """Every checkpoint directory of a run, complete or not, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        raise UserError(f"{run_dir}: no checkpoints/ directory; is this a run's output dir?")
    return [
        CheckpointInfo(step, path, committed, sum(f.stat().st_size for f in path.rglob("*") if f.is_file()))
        for step, committed, path in step_dirs(root)
    ]


def export(run_dir: Path, step: int | str | None, to: Path, export_format: str, options: dict[str, Any]) -> str:
    """Hand the model weights of a complete checkpoint (newest by default) to the plugin that
    writes ``export_format``: ``safetensors`` (on by default), ``hf`` (the hf provider), yours."""
    source = pick_checkpoint(run_dir, step)
    config = read_manifest(source).get("config") or {}
    written = export_plugins(source, config).calls.hook.export_model(
        state=read_model_state(source),
        config=config,
        run_dir=run_dir,
        checkpoint=source,
        export_format=export_format,
        to=to,
        options=options,
    )
    if written is None:
        raise UserError(
            f"--format {export_format}: no plugin writes that format; 'safetensors' is on by default "
            "(the hf model provider adds 'hf')"
        )
    return f"{written} (checkpoint {source})"


def export_plugins(source: Path, config: dict[str, Any]) -> Plugins:
    """The run's plugins (a format such as hf needs its provider's options) and every plugin that
    is on by default; only the latter when the run's no longer load (uninstalled, renamed)."""
    try:
        return load_plugins(structure(config, Config), autoload=True)
    except UserError as exc:
        logging.getLogger("coretrain").warning(
            "%s: the run's plugins do not load here (%s): only the on-by-default export formats", source, exc
        )
        return load_plugins(Config(), autoload=True)


def pick_checkpoint(run_dir: Path, step: int | str | None) -> Path:
    """A complete checkpoint: at ``step``, the one ``checkpoints/best`` points at, or the newest."""
    list_checkpoints(run_dir)  # a directory that is not a run's is named as such
    return find_checkpoint(run_dir / "checkpoints", step, "--step")


def read_model_state(source: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a complete checkpoint, read safely (shards gathered)."""
    if read_manifest(source)["layout"] == "sharded":
        weights = read_sharded_model(source / "sharded")
    else:
        weights = safeload.load_file(source / "model.pt")
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise CheckpointUnreadable(source, "the model weights are not a dict of tensors")
    return weights


def read_sharded_model(directory: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a DCP checkpoint, in this one process, read safely."""
    # dcp.load fills a copy of the dict it is given; torch's own dcp_to_torch_save calls this instead
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    safeload.check_metadata(directory)
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=safeload.dcp_reader(directory),
            planner=safeload.dcp_planner(directory, empty=True),
            no_dist=True,
        )
    except safeload.dcp_errors() as exc:
        raise safeload.dcp_unreadable(directory, exc) from None
    model = state.get("model")
    if not isinstance(model, dict):
        raise CheckpointUnreadable(directory, "no model state in the sharded checkpoint")
    return model
