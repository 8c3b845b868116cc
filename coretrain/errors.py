"""User-facing errors: one clear message and exit code 2, never a traceback."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Iterable
from types import ModuleType

USAGE_EXIT_CODE = 2


class UserError(Exception):
    """A mistake the user can fix (bad config, unknown plugin, missing file).

    The CLI prints ``str(error)`` and exits with :data:`USAGE_EXIT_CODE`; code paths that
    raise it must put everything the user needs into the message: where (file, line or key
    path), what was expected and, when we can guess it, a suggestion.
    """


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def require(module: str, *, needed_by: str, extra: str, package: str | None = None) -> ModuleType:
    """Import an optional dependency, or say which extra installs it (a UserError, not a traceback)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = package or module.split(".")[0].replace("_", "-")
        raise UserError(f"{needed_by} needs {package}: pip install 'coretrain[{extra}]'") from None
