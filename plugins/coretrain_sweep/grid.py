"""The points of a grid: parsed from ``--grid`` texts, named, and turned into ``--set`` texts."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from typing import Any

import tomli
from attrs import frozen

from coretrain import UserError

UNSAFE = re.compile(r"[^A-Za-z0-9_.,=+-]")
NAME_BYTES = 200
"""A point's directory name is cut to this, with a digest of the whole (file systems allow 255)."""
SET_BY_THE_SWEEP = ("run.output_dir",)
"""Keys each point's run gets from the sweep itself: a grid over them would be overwritten."""


@frozen
class Point:
    """One run of the grid."""

    index: int
    values: dict[str, Any]
    """Key path -> value."""
    name: str
    """Its directory name: ``lr=0.001,micro_batch_size=8``."""

    @property
    def sets(self) -> list[str]:
        """The values as ``--set`` texts (JSON literals are TOML literals for these types)."""
        return [f"{key}={json.dumps(value)}" for key, value in self.values.items()]


def parse_grid(texts: list[str]) -> dict[str, list[Any]]:
    """``["optimizer.lr=[1e-3, 3e-3]", ...]`` -> {"optimizer.lr": [0.001, 0.003], ...}."""
    grid: dict[str, list[Any]] = {}
    for text in texts:
        key, sep, value = text.partition("=")
        key = key.strip()
        try:
            values = tomli.loads(f"v = {value}")["v"] if sep else None
        except tomli.TOMLDecodeError:
            values = None
        if not key or not isinstance(values, list) or not values:
            raise UserError(
                f"--grid {text}: expected KEY.PATH=[V1, V2, ...] (a TOML array), e.g. optimizer.lr=[1e-3,3e-3]"
            )
        if any(isinstance(v, (dict, list)) for v in values):
            raise UserError(f"--grid {text}: each value must be a number, a string or a boolean")
        if key in grid:
            raise UserError(f"--grid {key}: given twice; put all its values in one array")
        if key in SET_BY_THE_SWEEP:
            raise UserError(
                f"--grid {key}: the sweep sets it for each point (OUTPUT_DIR/sweep/NAME); "
                "set the sweep's own directory with --set run.output_dir=..."
            )
        grid[key] = values
    return grid


def grid_size(grid: dict[str, list[Any]], most: int) -> int:
    """The number of points, refused above ``most`` before any is built."""
    size = math.prod(len(values) for values in grid.values())
    if size > most:
        shape = " × ".join(str(len(values)) for values in grid.values())
        raise UserError(
            f"--grid: {size:,} points ({shape}); more than --max-points {most:,}: narrow the grid, or raise "
            "--max-points if you mean it"
        )
    return size


def points(grid: dict[str, list[Any]]) -> list[Point]:
    """Every combination, the first key varying slowest (as nested loops over the --grid order)."""
    short = {key: key.rsplit(".", 1)[-1] for key in grid}
    if len(set(short.values())) < len(short):  # two keys end alike (optimizer.lr, plugins.x.lr): full keys
        short = {key: key for key in grid}
    combos = itertools.product(*grid.values())
    planned = [
        Point(index=i, values=dict(zip(grid, combo)), name=_name(f"{short[k]}={_text(v)}" for k, v in zip(grid, combo)))
        for i, combo in enumerate(combos)
    ]
    _refuse_shared_names(planned)
    return planned


def _name(parts: Any) -> str:
    """A directory name from ``key=value`` parts: unsafe characters as ``_``; a long one cut,
    with a digest of the whole so that names cut alike still differ."""
    whole = ",".join(parts)
    name = UNSAFE.sub("_", whole)
    if len(name) > NAME_BYTES:
        name = f"{name[: NAME_BYTES - 13]}-{hashlib.sha256(whole.encode()).hexdigest()[:12]}"
    return name


def _refuse_shared_names(planned: list[Point]) -> None:
    """Two points in one directory: the second would silently resume the first one's run."""
    seen: dict[str, Point] = {}
    for point in planned:
        first = seen.setdefault(point.name, point)
        if first is not point:
            raise UserError(
                f"--grid: points {first.index} ({first.sets}) and {point.index} ({point.sets}) would share the "
                f"directory {point.name!r} (a value's characters other than letters, digits and . , = + - become "
                "_); use values that differ in those"
            )


def _text(value: Any) -> str:
    return json.dumps(value).lower() if isinstance(value, bool) else str(value)
