"""``safetensors`` (on by default): ``coretrain checkpoint export --format safetensors`` writes one file.

An export format is a plugin like any other (hook ``export_model``); this one needs nothing of
the run, so the command finds it even when the run's own plugins are no longer installed.
The file appears whole or not at all: written beside ``--to`` and renamed over it.

Such a file is also weights to start from: ``checkpoint.pretrained`` naming one is read here
(hook ``read_pretrained``), by its header rather than its name, on any torch; torch's own
``torch.load`` reads safetensors only from 2.12 on, and only in a file named ``*.safetensors``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import torch
from attrs import define

from coretrain import UserError, hookimpl

FORMAT = "safetensors"


@define
class Safetensors:
    """The ``safetensors`` export format: the full model state dict as one ``.safetensors`` file."""

    @hookimpl
    def export_model(self, state: dict[str, torch.Tensor], to: Path, export_format: str) -> str | None:
        if export_format != FORMAT:
            return None
        replacing = check_export_target(to)
        write_atomically(state, to)
        return f"wrote {to}" + (" (replaced the file that was there)" if replacing else "")

    @hookimpl
    def read_pretrained(self, path: Path) -> dict[str, Any] | None:
        """``checkpoint.pretrained``'s file, when it is a safetensors file (tensors and a JSON
        header: nothing in it can run)."""
        if not holds_safetensors(path):
            return None
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(path, device="cpu")
        except (SafetensorError, OSError) as exc:
            reason = failure_reason(exc)
            raise UserError(
                f"checkpoint.pretrained: {path} is a safetensors file that cannot be read: {reason}"
            ) from None


def write_atomically(state: dict[str, torch.Tensor], to: Path) -> None:
    """Write ``to`` whole or not at all (a temporary file beside it, renamed over it)."""
    from safetensors.torch import save_file

    partial = to.parent / f".{to.name}.{os.getpid()}.tmp"
    try:  # tied parameters share storage; safetensors stores each name on its own
        save_file({name: tensor.contiguous().clone() for name, tensor in state.items()}, str(partial), {"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o666 & ~umask)  # safetensors creates it 0600; an export is for others to read
        os.replace(partial, to)
    except Exception as exc:  # OSError, or safetensors' own SafetensorError for the same causes
        partial.unlink(missing_ok=True)
        reason = failure_reason(exc)
        raise UserError(f"cannot write {to}: {reason}") from None


def failure_reason(exc: Exception) -> str:
    """The cause in a few words: an OSError's own (a full disk, no permission), else safetensors'
    first line."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc).splitlines()[0]


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


def holds_safetensors(path: Path) -> bool:
    """Whether ``path`` is a safetensors file, whatever its name: its header's length, then the
    header's JSON (a torch file starts a zip or a pickle)."""
    try:
        with open(path, "rb") as stream:
            head = stream.read(9)
        return len(head) == 9 and head[8:] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size
    except OSError:  # a directory, or nothing there: the checkpoint loader says what it is
        return False
