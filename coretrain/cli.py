"""Command line: ``coretrain COMMAND``, each command from the ``coretrain.commands`` entry points.

The core's own command (run) is registered in that group exactly as a third-party package's
are (``checkpoint``, ``config``, ``plugins``, ``report``, ``launch`` ... are coretrain-plugins'),
as pytest ships its own features as plugins. ``run`` is added first, so a
command module may extend it (``launch`` gives it ``--nproc-per-node``). Only argparse is
imported at module level, so ``coretrain --help`` starts fast and never imports torch; each
command imports what it needs. A :class:`UserError` from anywhere becomes one ``error:`` line and exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from typing import NoReturn

from coretrain.version import __version__

COMMANDS_GROUP = "coretrain.commands"


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a mistake in the command line said in one ``error:`` line (exit 2) that
    names where to look, instead of the whole usage text first. Subcommands' parsers are of this
    class too (``add_subparsers`` makes them so)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The parser with every command of the ``coretrain.commands`` entry-point group (``run``
    first), so an installed distribution adds its own; one that fails to load is skipped with a
    line, not a traceback for every other command."""
    parser = OneLineParser(prog="coretrain", description="Train PyTorch models; every feature is a plugin.")
    parser.add_argument("--version", action="version", version=f"coretrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for point in sorted(entry_points(group=COMMANDS_GROUP), key=lambda p: (p.name != "run", p.name)):
        try:
            point.load()(commands)
        except Exception as exc:  # a broken command package must not take the others down
            source = point.dist.name if point.dist else point.value
            print(f"coretrain: command {point.name!r} from {source} is skipped: {exc}", file=sys.stderr)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, run the command, and turn what it raises into one line and an exit code: 2 for the
    user's mistake, 1 for a failure; an exception of any other kind is a bug and keeps its
    traceback."""
    args = build_parser().parse_args(argv)  # loads every command's package: may take a moment
    from coretrain.errors import FAILURE_EXIT_CODE, USAGE_EXIT_CODE, PluginError, RunFailure, UserError

    if getattr(signal.getsignal(signal.SIGINT), "coretrain_start_up", 0) and not getattr(args, "own_signals", 0):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the start-up handler's job is done
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        print("error: the current directory no longer exists (deleted?); cd to one that does", file=sys.stderr)
        return 2
    if cwd not in sys.path and "" not in sys.path:  # ./mymodule:build, as `python -m coretrain` finds it,
        sys.path.append(cwd)  # but last: a file in the directory never stands in for an installed package
    try:
        return int(args.handler(args) or 0)
    except (UserError, RunFailure, PluginError) as exc:  # the user's to fix (exit 2), or a failure (exit 1)
        print(f"error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE if isinstance(exc, UserError) else FAILURE_EXIT_CODE
    except BrokenPipeError:  # the reader stopped early (`coretrain config show | head`): no error, no traceback
        with contextlib.suppress(Exception):  # and no second one when the interpreter flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:  # before the run's own handler was installed
        print("error: interrupted", file=sys.stderr)
        return 130
