"""Look into a run's checkpoints and take the weights out: ``coretrain checkpoint list | export``.

Works on any run directory, without building the run; sharded (FSDP) checkpoints are
gathered into one state dict in this process by the core's restricted readers (``read_weights``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, cast

import attrs
from coretrain_keep_best.link import require_best

import coretrain
from coretrain import UserError, find_checkpoint, read_manifest, read_weights, step_dirs
from coretrain_checkpoint_command.hookspecs import CheckpointSpecs


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
    written = cast(CheckpointSpecs, export_plugins(source, config).calls.hook).export_model(
        state=read_weights(source),
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


def export_plugins(source: Path, config: dict[str, Any]) -> Any:
    """The run's plugins (a format such as hf needs its provider's options) and every plugin that
    is on by default; only the latter when the run's no longer load (uninstalled, renamed)."""
    try:
        return coretrain.load_plugins(config, autoload=True)
    except UserError as exc:
        logging.getLogger("coretrain").warning(
            "%s: the run's plugins do not load here (%s): only the on-by-default export formats", source, exc
        )
        return coretrain.load_plugins({}, autoload=True)


def pick_checkpoint(run_dir: Path, step: int | str | None) -> Path:
    """A complete checkpoint: at ``step``, the one ``checkpoints/best`` points at, or the newest."""
    list_checkpoints(run_dir)  # a directory that is not a run's is named as such
    if step == "best":
        require_best(run_dir / "checkpoints", "--step")
    return find_checkpoint(run_dir / "checkpoints", step, "--step")
