"""Config keys that moved, with their feature, to a plugin's table: the old spelling still works.

A key users have is never removed silently: a config (or a checkpoint's saved config) that
uses an old key is read as if it used the new one, and the first use in a process logs one
deprecation warning naming the new key. Listed under "Deprecated" in CHANGELOG.md.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from coretrain.errors import UserError

log = logging.getLogger("coretrain")

MOVED: dict[str, tuple[str, bool]] = {
    "scheduler": ("plugins.schedule", True),
    "checkpoint.keep_best": ("plugins.keep-best.metric", True),
    "run.peak_tflops": ("plugins.timers.peak_tflops", True),
    "distributed.step_timeout_seconds": ("plugins.watchdog.step_timeout_seconds", True),
    "checkpoint.keep_best_mode": ("plugins.keep-best.mode", False),
    "checkpoint.allow_changes": ("plugins.resume-checks.allow_changes", True),
}
"""Old dotted key -> (new dotted key, whether the old key alone turns the new table on: a
secondary key such as a mode, set without its feature, is dropped)."""

_warned: set[str] = set()


def move_keys(
    data: dict[str, Any],
    locations: MutableMapping[tuple[str, ...], str] | None = None,
    secondaries: set[tuple[str, ...]] | None = None,
) -> None:
    """Rewrite old keys in ``data`` (TOML-shaped) as their new ones; warn once per old key
    when ``locations`` is given (a config being loaded, not a checkpoint's saved one).

    ``data`` may be one layer of a config (a file, an override): each layer is moved before the
    layers are merged, so a layer's value wins over its base's whatever spelling either uses.
    Then a secondary key moves even where its table is not in the layer (the base may turn the
    feature on), and its table is noted in ``secondaries`` for :func:`drop_lone_secondaries`
    to judge once the layers are merged."""
    for old, (new, turns_on) in MOVED.items():
        *old_table, old_name = old.split(".")
        *new_table, new_name = new.split(".")
        holder = _table(data, old_table)
        if holder is None or old_name not in holder:
            continue
        value = holder.pop(old_name)
        target = _table(data, new_table, create=turns_on or secondaries is not None)
        if not turns_on and secondaries is not None:
            secondaries.add(tuple(new_table))
        if locations is not None:
            where = _move_locations(locations, tuple(old.split(".")), tuple(new.split(".")))
            if old not in _warned:
                _warned.add(old)
                log.warning("%s%s is deprecated: it is %s now; rename it", f"{where}: " if where else "", old, new)
        if target is None:
            continue
        if isinstance(value, dict) and isinstance(target.get(new_name), dict):
            value = {**value, **target[new_name]}  # a whole table: the new spelling's keys win
        elif new_name in target and target[new_name] != value:
            raise UserError(f"{old} (deprecated) and {new} are both set, to different values; keep only {new}")
        target[new_name] = value


def _move_locations(
    locations: MutableMapping[tuple[str, ...], str], old: tuple[str, ...], new: tuple[str, ...]
) -> str | None:
    """Error messages about the moved key (or the keys of a moved table) point at the old lines."""
    moved = [key for key in locations if key[: len(old)] == old]
    for key in moved:
        locations[new + key[len(old) :]] = locations.pop(key)
    return locations.get(new) or next((locations[new + key[len(old) :]] for key in moved), None)


def _table(data: dict[str, Any], path: list[str], create: bool = False) -> dict[str, Any] | None:
    """The table at ``path`` (made on the way when ``create``), or None when something else is there."""
    node: Any = data
    for key in path:
        if not isinstance(node, dict) or (key not in node and not create):
            return None
        node = node.setdefault(key, {})
    return node if isinstance(node, dict) else None


def drop_lone_secondaries(data: dict[str, Any], secondaries: set[tuple[str, ...]]) -> None:
    """A table that holds only secondary keys moved into it (a mode without its feature, in
    every layer) is dropped, as a secondary key set alone always was."""
    for table in secondaries:
        found = _table(data, list(table))
        own = {
            new.split(".")[-1]
            for new, turns_on in MOVED.values()
            if not turns_on and tuple(new.split(".")[:-1]) == table
        }
        if found is not None and set(found) <= own:
            parent = _table(data, list(table[:-1]))
            if parent is not None:
                parent.pop(table[-1], None)
