"""``coretrain new-plugin NAME``: write a third-party plugin package that installs and passes its tests.

A command plugin (the ``coretrain.commands`` entry-point group), as a third party's command
would be; the templates are in :mod:`coretrain_scaffold.scaffold`.
"""

from __future__ import annotations

import argparse
from typing import Any


def add(commands: Any) -> None:
    """Add ``new-plugin`` to ``coretrain``'s subcommands."""
    scaffold = commands.add_parser(
        "new-plugin", help="write a plugin package (entry point, one option, one hook, a test) ready to pip install"
    )
    scaffold.add_argument("name", help="the plugin's name, e.g. loss-spikes (enabled by [plugins.loss-spikes])")
    scaffold.add_argument(
        "--dir",
        default=None,
        metavar="D",
        help="the package's directory if D is new or empty, else D/coretrain-NAME (default: ./coretrain-NAME)",
    )
    scaffold.set_defaults(handler=cmd_new_plugin)


def cmd_new_plugin(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coretrain_scaffold.scaffold import new_plugin

    root = new_plugin(args.name, Path(args.dir) if args.dir else None)
    print(f"wrote {root}; next: cd {root} && pip install -e '.[test]' && pytest")
    return 0
