"""What a resume does with each config key that changed since the checkpoint: apply or refuse.

A checkpoint's weights, data position and random streams mean something only together with
the config they were trained under. Some keys may change on resume and take effect from the
first resumed step (the learning rate, the batch size, the cadence, plugins); others would
silently change what the run is (another seed reorders the data from here on; another
``n_head`` reinterprets the same weights; another dataset makes the data position point at
other samples). Every key has one rule, by its longest listed prefix; keys not listed are
applied. Applied changes are listed in one warning; refused ones are one error naming them,
unless the user lists them in ``checkpoint.allow_changes``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from coretrain.errors import UserError
from coretrain.movedkeys import move_keys

log = logging.getLogger("coretrain")

REFUSED = {
    "run.seed": "the data order and every random stream follow it",
    "model": "the checkpoint's weights are those of the model it configured",
    "data.provider": "the data position counts samples of the dataset it built",
    "data.options": "the data position counts samples of the dataset it built",
}
"""Key (or section prefix) -> why a change is refused. Everything else is applied."""


def config_changes(saved: dict[str, Any] | None, current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, checkpoint's value, current value) for every leaf that differs."""
    if not saved:
        return []
    saved = json.loads(json.dumps(saved))
    move_keys(saved)  # a checkpoint written before a key moved to its plugin's table
    now = json.loads(json.dumps(current))  # tuples as lists, as the manifest has them
    changes: list[tuple[str, Any, Any]] = []

    def walk(before: Any, after: Any, prefix: str) -> None:
        if isinstance(before, dict) and isinstance(after, dict):
            for key in sorted(set(before) | set(after)):
                walk(before.get(key), after.get(key), f"{prefix}{key}.")
        elif before != after:
            changes.append((prefix.rstrip("."), before, after))

    walk(saved, now, "")
    return changes


def refusal(key: str, allowed: list[str]) -> str | None:
    """Why a change of ``key`` is refused, or None when it is applied."""
    if any(key == a or key.startswith(f"{a}.") for a in allowed):
        return None
    parts = key.split(".")
    for end in range(len(parts), 0, -1):
        reason = REFUSED.get(".".join(parts[:end]))
        if reason is not None:
            return reason
    return None


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{key} {before!r} -> {after!r}" for key, before, after in changes)


def check_changes(
    saved: dict[str, Any] | None, current: dict[str, Any], allowed: list[str], source: Path | None
) -> None:
    """Refuse the changes a resume must not make (one error naming them all); warn once about the rest."""
    changes = config_changes(saved, current)
    refused = [(change, why) for change in changes if (why := refusal(change[0], allowed)) is not None]
    if refused:
        reasons = "; ".join(f"{key} {before!r} -> {after!r}: {why}" for (key, before, after), why in refused)
        keys = json.dumps([key for (key, _, _), _ in refused])
        raise UserError(
            f"resuming from {source or 'the checkpoint'} would change what it means: {reasons}. Resume with "
            f"the checkpoint's values; or start a new run (another run.output_dir) from its weights with "
            f'checkpoint.pretrained = "{source or "STEP_DIR"}"; or apply them anyway with '
            f"checkpoint.allow_changes = {keys}"
        )
    if changes:
        log.warning("resuming with changed settings; the config's values are used from now on: %s", describe(changes))
