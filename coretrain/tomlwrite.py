"""Write plain data as TOML (for the resolved config.toml saved with every run).

tomli only reads; this covers what configs hold (tables, strings, numbers, booleans, lists)
in a few lines instead of adding a dependency. ``None`` means "unset" and is left out.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def key(name: str) -> str:
    return name if _BARE_KEY.match(name) else json.dumps(name)


def value(obj: Any) -> str:
    if isinstance(obj, bool):
        return "true" if obj else "false"
    if isinstance(obj, int):
        return str(obj)
    if isinstance(obj, float):
        if math.isnan(obj):
            return "nan"
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return repr(obj)
    if isinstance(obj, str):
        return json.dumps(obj)
    if isinstance(obj, (list, tuple)):
        return "[" + ", ".join(value(v) for v in obj if v is not None) + "]"
    if isinstance(obj, Mapping):
        return "{" + ", ".join(f"{key(k)} = {value(v)}" for k, v in obj.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(obj).__name__} as TOML")


_NO_DEFAULT = object()


def dumps(data: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> str:
    """Scalars of a table first, then each sub-table under its own ``[a.b]`` header.

    With ``defaults`` (the same shape: ``coretrain config show``), unset values appear as
    comments and each value that differs from its default says what the default was.
    """
    return "\n\n".join(block.rstrip("\n") for block in _blocks(data, defaults, ()) if block.strip()) + "\n"


def _blocks(data: Mapping[str, Any], defaults: Mapping[str, Any] | None, path: tuple[str, ...]) -> list[str]:
    written = (_line(k, v, defaults) for k, v in data.items() if not isinstance(v, Mapping))
    lines = [line for line in written if line is not None]
    blocks = []
    if lines or (path and not data):
        header = "[" + ".".join(key(p) for p in path) + "]\n" if path else ""
        blocks.append(header + "\n".join(lines))
    for k, v in data.items():
        if isinstance(v, Mapping):
            sub = defaults.get(k, {}) if defaults is not None else None
            blocks += _blocks(v, sub if isinstance(sub, Mapping) or sub is None else {}, (*path, k))
    return blocks


def _line(name: str, obj: Any, defaults: Mapping[str, Any] | None) -> str | None:
    if defaults is None:
        return None if obj is None else f"{key(name)} = {value(obj)}"
    line = f"# {key(name)} = (unset)" if obj is None else f"{key(name)} = {value(obj)}"
    default = defaults.get(name, _NO_DEFAULT)
    if default is _NO_DEFAULT:
        return line + "  # set (no default)"
    if default != obj:
        return line + f"  # default: {'(unset)' if default is None else value(default)}"
    return line
