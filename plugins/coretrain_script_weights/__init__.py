"""``script-weights`` (on by default): ``checkpoint.pretrained`` naming a file a training script
saved with ``torch.save`` — the state dict itself, or under ``model`` / ``state_dict`` /
``model_state_dict`` (nanoGPT's ``ckpt.pt``, most scripts'), with its names taken without
torch.compile's ``_orig_mod.`` or DDP's ``module.`` before each (hook ``read_pretrained``).

Read through torch's allowlist unpickler (``weights_only=True``), as the core reads its own
checkpoints; a file that refuses or fails it is left to the core's reader, which names the
file and says why (a crafted file, a damaged one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from attrs import define

from coretrain import hookimpl

HOLDERS = ("model", "state_dict", "model_state_dict")
"""Where scripts keep the weights beside their step, optimizer and config."""
PREFIXES = ("_orig_mod.", "module.")
"""What torch.compile's and DDP's wrappers put before every name of the model they wrap."""


@define
class ScriptWeights:
    """Weights to start from in a file another training loop saved."""

    @hookimpl
    def read_pretrained(self, path: Path) -> dict[str, Any] | None:
        if not path.is_file():
            return None  # a coretrain checkpoint's directory: the core's
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # not torch's, crafted or damaged: the core's reader says which
            return None
        return state_dict_in(saved) if isinstance(saved, dict) else None


def state_dict_in(saved: dict[str, Any]) -> dict[str, Any]:
    """The model's weights in what a script saved: the dict itself, or the one it holds under
    one of :data:`HOLDERS`, each of its names without a wrapper's prefix."""
    held = next((saved[key] for key in HOLDERS if isinstance(saved.get(key), dict)), saved)
    for prefix in PREFIXES:
        if held and all(str(name).startswith(prefix) for name in held):
            held = {name.removeprefix(prefix): value for name, value in held.items()}
    return held
