"""``coretrain plugins``: what is installed, its hooks and options."""

from __future__ import annotations

import argparse
from typing import Any


def add(commands: Any) -> None:
    """Add this module's command(s) to ``coretrain``'s subcommands."""
    plugins = commands.add_parser("plugins", help="list installed plugins, their hooks and config fields")
    plugins.add_argument("names", nargs="*", metavar="NAME", help="only these plugins (default: all, and commands)")
    plugins.set_defaults(handler=cmd_plugins)


def cmd_plugins(args: argparse.Namespace) -> int:
    from coretrain.errors import UserError, did_you_mean
    from coretrain.pluginmanager import INSTALL_HINT, discover

    installed = discover()
    if not installed:
        print(f"No coretrain plugins installed; {INSTALL_HINT}.")
        return 0
    for name in args.names:
        if name not in installed:
            raise UserError(
                f"no plugin '{name}' is installed{did_you_mean(name, installed)}; `coretrain plugins` lists all"
            )
    if not args.names:
        print(f"{len(installed)} plugins installed (entry-point group 'coretrain'):\n")
    for name in args.names or sorted(installed):
        entry = installed[name]
        try:
            cls = entry.load()
        except UserError as exc:
            print(f"{name}  {entry.origin}  broken: {exc}\n")
            continue
        _print_plugin(name, entry, cls)
    if not args.names:
        _print_commands()
    return 0


def _print_plugin(name: str, entry: Any, cls: type) -> None:
    """Name, origin, how it is turned on, first doc line, hooks, options with defaults and docs."""
    import attrs

    from coretrain.pluginmanager import field_defaults, field_docs, hooks_of

    hooks = hooks_of(cls)
    if providers := [h for h in hooks if h.startswith("provide_")]:
        section = "model" if "provide_model" in providers else "data"
        state = f'provider: set {section}.provider = "{name}", options in [{section}.options]'
    else:
        state = (
            "on by default (disable: enabled = false)" if entry.autoload else f"off unless configured: [plugins.{name}]"
        )
    print(f"{name}  {entry.origin}  {state}")
    if doc := (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "":
        print(f"  {doc}")
    print(f"  hooks: {', '.join(hooks) or '(none)'}")
    docs, defaults = field_docs(cls), field_defaults(cls)
    for f in (f for f in attrs.fields(cls) if f.init):
        default = repr(defaults[f.name]) if f.name in defaults else "required"
        type_name = getattr(f.type, "__name__", None) or str(f.type)
        print(f"    {f.name}: {type_name} = {default}" + (f"  {docs[f.name]}" if f.name in docs else ""))
    print()


def _print_commands() -> None:
    """The commands, and which distribution adds each (a command plugin is removable too)."""
    from importlib.metadata import entry_points

    from coretrain.cli import COMMANDS_GROUP

    points = sorted(entry_points(group=COMMANDS_GROUP), key=lambda p: p.name)
    print(f"{len(points)} commands (entry-point group '{COMMANDS_GROUP}'):")
    for point in points:
        origin = f"{point.dist.name} {point.dist.version}" if point.dist else "?"
        print(f"  {point.name}  {origin}  {point.value}")
