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
    """Return ``" (did you mean 'x'?)"`` for the closest choice, or ``""``: a choice equal but
    for case first ('adamW' is 'adamw', not 'adam'), else the closest spelling."""
    options = [str(choice) for choice in choices]
    same = [choice for choice in options if choice.lower() == word.lower()]
    close = same or difflib.get_close_matches(word.lower(), [o.lower() for o in options], n=1, cutoff=0.6)
    if close and not same:
        close = [next(o for o in options if o.lower() == close[0])]
    return f" (did you mean '{close[0]}'?)" if close else ""


def require(module: str, *, needed_by: str, extra: str, package: str | None = None) -> ModuleType:
    """Import an optional dependency, or say which extra installs it (a UserError, not a traceback)."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = package or module.split(".")[0].replace("_", "-")
        raise UserError(f"{needed_by} needs {package}: pip install 'coretrain-plugins[{extra}]'") from None


class CheckpointUnreadable(UserError):
    """A checkpoint file that cannot be loaded; ``unsafe`` when it holds more than plain data.

    An automatic resume falls back to an older checkpoint past a corrupt one, never past an
    unsafe one: a file that names code to run was crafted, and a person should look.
    """

    def __init__(self, path: object, reason: str, *, unsafe: bool = False) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason, self.unsafe = path, reason, unsafe


FAILURE_EXIT_CODE = 1


class PluginError(Exception):
    """A plugin's hook raised: the run stops with one line naming plugin, hook and step (exit 1)."""

    def __init__(self, plugin: str, hook: str, cause: BaseException, step: int | None = None) -> None:
        super().__init__(plugin, hook, step)
        self.plugin, self.hook, self.cause, self.step = plugin, hook, cause, step

    def __str__(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        return f"plugin '{self.plugin}' failed in {self.hook}{at}: {summary(self.cause)}".rstrip(": ")


class RunFailure(Exception):
    """Something outside the user's config went wrong (a full disk, a failing write): one line, exit 1."""


def summary(exc: BaseException) -> str:
    """``Type: first line`` of an exception, for one error line. An error re-raised from a
    DataLoader worker carries the worker's own traceback as text; its last line is the message
    the user's code raised, which the first line ("Caught X in DataLoader worker process 0.")
    would lose."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Caught ") and "Original Traceback" in lines[1]:
        where = lines[0].removeprefix("Caught ").split(" in ", 1)[-1].rstrip(".")
        return f"{lines[-1]} (in {where})"
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
