"""The config keys that changed since a checkpoint was written: what a resume checks them against
(the ``resume-checks`` plugin refuses some; the core names them in its own errors).
"""

from __future__ import annotations

import json
from typing import Any

from coretrain.movedkeys import move_keys


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
