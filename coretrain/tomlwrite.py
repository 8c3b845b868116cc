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


def dumps(data: Mapping[str, Any], _prefix: tuple[str, ...] = ()) -> str:
    """Scalars of a table first, then each sub-table under its own ``[a.b]`` header."""
    lines = [f"{key(k)} = {value(v)}" for k, v in data.items() if v is not None and not isinstance(v, Mapping)]
    blocks = ["\n".join(lines)] if lines else []
    for k, v in data.items():
        if isinstance(v, Mapping):
            path = (*_prefix, k)
            header = "[" + ".".join(key(p) for p in path) + "]"
            body = dumps(v, path)
            has_scalars = any(not isinstance(x, Mapping) and x is not None for x in v.values())
            blocks.append(f"{header}\n{body}" if has_scalars or not v else body)
    return "\n\n".join(b.rstrip("\n") for b in blocks if b) + "\n"
