"""Look into a run's checkpoints and take the weights out: ``coretrain checkpoint list | export``.

Works on any run directory, without building the run; sharded (FSDP) checkpoints are
gathered into one state dict in this process, through the same restricted readers as resume.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import attrs
import torch

from coretrain import safeload
from coretrain.checkpoint import read_manifest, step_dirs
from coretrain.errors import CheckpointUnreadable, RunFailure, UserError


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


def export(run_dir: Path, step: int | None, to: Path, export_format: str, options: dict[str, Any]) -> str:
    """Write the model weights of a complete checkpoint (newest by default) in ``export_format``:
    ``safetensors`` here, any other format by the plugin of the run's config that writes it."""
    source = pick_checkpoint(run_dir, step)
    if export_format == "safetensors":
        return write_safetensors(read_model_state(source), source, to)
    from coretrain.config import Config
    from coretrain.configload import structure
    from coretrain.pluginmanager import load_plugins

    config = read_manifest(source).get("config") or {}
    if not config:
        raise UserError(f"{source}: the checkpoint does not record its config (written by coretrain < 0.2)")
    plugins = load_plugins(structure(config, Config))
    written = plugins.calls.export_model(
        state=read_model_state(source),
        config=config,
        run_dir=run_dir,
        export_format=export_format,
        to=to,
        options=options,
    )
    if written is None:
        raise UserError(
            f"--format {export_format}: no plugin of this run writes that format; 'safetensors' is built in "
            "(the hf model provider adds 'hf')"
        )
    return f"{written} (checkpoint {source})"


def pick_checkpoint(run_dir: Path, step: int | None) -> Path:
    complete = {c.step: c.path for c in list_checkpoints(run_dir) if c.complete}
    if not complete:
        raise UserError(f"{run_dir}: no complete checkpoint to export")
    if step is not None and step not in complete:
        raise UserError(f"--step {step}: no complete checkpoint at that step; complete: {sorted(complete)}")
    return complete[step if step is not None else max(complete)]


def read_model_state(source: Path) -> dict[str, torch.Tensor]:
    """The full model state dict of a complete checkpoint, read safely (shards gathered)."""
    if read_manifest(source)["layout"] == "sharded":
        weights = read_sharded_model(source / "sharded")
    else:
        weights = safeload.load_file(source / "model.pt")
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise CheckpointUnreadable(source, "the model weights are not a dict of tensors")
    return weights


def write_safetensors(weights: dict[str, torch.Tensor], source: Path, to: Path) -> str:
    """Write ``to`` whole or not at all (a temporary file beside it, renamed over it); what was done."""
    from safetensors.torch import save_file

    replacing = check_export_target(to)
    partial = to.parent / f".{to.name}.{os.getpid()}.tmp"
    try:  # tied parameters share storage; safetensors stores each name on its own
        save_file(
            {name: tensor.contiguous().clone() for name, tensor in weights.items()},
            str(partial),
            metadata={"format": "pt", "source": str(source)},
        )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)  # safetensors creates it 0600; an export is for others to read
        os.replace(partial, to)
    except Exception as exc:  # OSError, or safetensors' own SafetensorError for the same causes
        partial.unlink(missing_ok=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise RunFailure(f"cannot write {to}: {reason}") from None
    return f"wrote {to} from {source}" + (" (replaced the file that was there)" if replacing else "")


def check_export_target(to: Path) -> bool:
    """Refuse anything but a new path or a regular file to replace; True when one is replaced."""
    if not to.parent.is_dir():
        raise UserError(f"--to: directory '{to.parent}' does not exist; create it first")
    if not os.access(to.parent, os.W_OK | os.X_OK):
        raise UserError(f"--to: no permission to write in '{to.parent}'; choose another place")
    try:
        mode = to.lstat().st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(mode):
        raise UserError(f"--to: '{to}' is a directory; give a file name, e.g. {to / 'model.safetensors'}")
    if not stat.S_ISREG(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
        raise UserError(f"--to: '{to}' exists and is {kind}; give a new file name (or a regular file to replace)")
    return True


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
