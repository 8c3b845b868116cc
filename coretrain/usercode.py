"""User code named in the config by import path (``model.provider = "pkg.mod:fn"``): import it,
check the options against its signature, call it with what it asks for."""

from __future__ import annotations

import importlib
import inspect
import sys
from typing import Any

from coretrain.errors import UserError, did_you_mean


def import_callable(path: str, key: str) -> Any:
    """``pkg.mod:attr.attr`` imported, or one UserError naming ``key``: a module that is not found
    (with where it was looked for), or one that fails as it loads, says so in the user's terms."""
    module_name, _, attr = path.partition(":")
    if not module_name.strip() or not attr.strip() or "" in attr.split("."):
        raise UserError(f"{key}: '{path}' is not an import path; expected 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except Exception as exc:  # ImportError, AttributeError, or whatever the module raised as it loaded
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        not_found = isinstance(exc, ModuleNotFoundError) and f"{module_name}.".startswith(f"{exc.name}.")
        if not_found or getattr(sys.modules.get(module_name), "__file__", "") is None:  # or a folder of that name
            first += " (looked for in the current directory and on PYTHONPATH: run from its folder, or add it there)"
        raise UserError(f"{key}: cannot import '{path}': {type(exc).__name__}: {first}") from None
    if not callable(obj):
        raise UserError(f"{key}: '{path}' is not callable")
    return obj


def check_options(fn: Any, options: dict[str, Any], key: str, available: tuple[str, ...]) -> None:
    """The options fit ``fn``'s signature (``available`` names are passed by coretrain when asked for)."""
    signature = inspect.signature(fn)
    passed = {name: None for name in available if name in signature.parameters}
    try:
        signature.bind(**passed, **options)
    except TypeError as exc:
        accepted = [n for n in signature.parameters if n not in available]
        hint = "".join(did_you_mean(k, accepted) for k in options if k not in signature.parameters)
        raise UserError(
            f"{key}: options do not fit {fn.__module__}.{fn.__qualname__}: {exc}{hint}; "
            f"it accepts: {', '.join(accepted) or 'no options'}"
        ) from None


def call_with(fn: Any, options: dict[str, Any], key: str, **available: Any) -> Any:
    """Call ``fn(**options)``, also passing ``run`` / ``context`` when its signature asks for them."""
    parameters = inspect.signature(fn).parameters
    return fn(**{name: value for name, value in available.items() if name in parameters}, **options)
