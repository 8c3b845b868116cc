"""``coretrain plugins`` (what is installed, its hooks and options) and ``coretrain new-plugin NAME``."""

from __future__ import annotations

import argparse
from typing import Any


def add(commands: Any) -> None:
    """Add this module's command(s) to ``coretrain``'s subcommands."""
    plugins = commands.add_parser("plugins", help="list installed plugins, their hooks and config fields")
    plugins.set_defaults(handler=cmd_plugins)

    scaffold = commands.add_parser(
        "new-plugin", help="write a plugin package (entry point, one option, one hook, a test) ready to pip install"
    )
    scaffold.add_argument("name", help="the plugin's name, e.g. loss-spikes (enabled by [plugins.loss-spikes])")
    scaffold.add_argument("--dir", default=None, metavar="D", help="where to write it (default: ./coretrain-NAME)")
    scaffold.set_defaults(handler=cmd_new_plugin)


def cmd_new_plugin(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coretrain.scaffold import new_plugin

    root = new_plugin(args.name, Path(args.dir) if args.dir else None)
    print(f"wrote {root}; next: cd {root} && pip install -e '.[test]' && pytest")
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    import attrs
    from rich.console import Console
    from rich.markup import escape

    from coretrain.errors import UserError
    from coretrain.pluginmanager import INSTALL_HINT, discover, field_defaults, field_docs, hooks_of

    console = Console(highlight=False, soft_wrap=True)
    installed = discover()
    if not installed:
        console.print(f"No coretrain plugins installed; {INSTALL_HINT}.")
        return 0
    console.print(f"{len(installed)} plugins installed (entry-point group 'coretrain'):\n")
    for name, entry in sorted(installed.items()):
        try:
            cls = entry.load()
        except UserError as exc:
            console.print(f"[bold]{name}[/]  {entry.origin}  [red]broken[/]: {escape(str(exc))}\n")
            continue
        hooks = hooks_of(cls)
        providers = [h for h in hooks if h.startswith("provide_")]
        if providers:
            section = "model" if "provide_model" in providers else "data"
            state = escape(f'provider: set {section}.provider = "{name}", options in [{section}.options]')
        elif entry.autoload:
            state = "[green]on by default[/] (disable: enabled = false)"
        else:
            state = escape(f"off unless configured: [plugins.{name}]")
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        console.print(f"[bold]{name}[/]  {escape(entry.origin)}  {state}")
        if doc:
            console.print(f"  {escape(doc)}")
        console.print(f"  hooks: {', '.join(hooks) or '(none)'}")
        docs = field_docs(cls)
        defaults = field_defaults(cls)
        for f in (f for f in attrs.fields(cls) if f.init):
            default = repr(defaults[f.name]) if f.name in defaults else "required"
            type_name = getattr(f.type, "__name__", None) or str(f.type)
            console.print(
                f"    {f.name}: {escape(type_name)} = {escape(default)}"
                + (f"  [dim]{escape(docs[f.name])}[/]" if f.name in docs else "")
            )
        console.print()
    _print_commands(console)
    return 0


def _print_commands(console: Any) -> None:
    """The commands, and which distribution adds each (a command plugin is removable too)."""
    from importlib.metadata import entry_points

    from rich.markup import escape

    from coretrain.cli import COMMANDS_GROUP

    points = sorted(entry_points(group=COMMANDS_GROUP), key=lambda p: p.name)
    console.print(f"{len(points)} commands (entry-point group '{COMMANDS_GROUP}'):")
    for point in points:
        origin = f"{point.dist.name} {point.dist.version}" if point.dist else "?"
        console.print(f"  [bold]{point.name}[/]  {escape(origin)}  {escape(point.value)}")
