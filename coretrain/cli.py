"""Command line: ``coretrain run | checkpoint | report | plugins | new-plugin | config show | config validate``.

Only argparse is imported at module level, so ``coretrain --help`` starts fast and never
imports torch; each command imports what it needs. A :class:`UserError` from anywhere
becomes one ``error:`` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from coretrain import __version__
from coretrain.commands import checkpoint, config, plugins, report, run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coretrain", description="Train PyTorch models; every feature is a plugin.")
    parser.add_argument("--version", action="version", version=f"coretrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (run, checkpoint, report, plugins, config):
        command.add(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cwd = os.getcwd()
    except FileNotFoundError:
        print("error: the current directory no longer exists (deleted?); cd to one that does", file=sys.stderr)
        return 2
    if cwd not in sys.path and "" not in sys.path:  # as `python -m coretrain` does: ./mymodule:build
        sys.path.insert(0, cwd)
    from coretrain.errors import FAILURE_EXIT_CODE, USAGE_EXIT_CODE, PluginError, RunFailure, UserError

    try:
        return int(args.handler(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except (RunFailure, PluginError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return FAILURE_EXIT_CODE
    except KeyboardInterrupt:  # before the run's own handler was installed
        print("error: interrupted", file=sys.stderr)
        return 130
