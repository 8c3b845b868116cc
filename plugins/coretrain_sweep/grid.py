"""The points of a grid: parsed from ``--grid`` texts, named, and turned into ``--set`` texts."""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

import tomli
from attrs import frozen

from coretrain import UserError

UNSAFE = re.compile(r"[^A-Za-z0-9_.,=+-]")


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
        grid[key] = values
    return grid


def points(grid: dict[str, list[Any]]) -> list[Point]:
    """Every combination, the first key varying slowest (as nested loops over the --grid order)."""
    short = {key: key.rsplit(".", 1)[-1] for key in grid}
    if len(set(short.values())) < len(short):  # two keys end alike (optimizer.lr, plugins.x.lr): full keys
        short = {key: key for key in grid}
    combos = itertools.product(*grid.values())
    return [
        Point(
            index=i,
            values=dict(zip(grid, combo)),
            name=UNSAFE.sub("_", ",".join(f"{short[k]}={_text(v)}" for k, v in zip(grid, combo))),
        )
        for i, combo in enumerate(combos)
    ]


def _text(value: Any) -> str:
    return json.dumps(value).lower() if isinstance(value, bool) else str(value)
