"""``coretrain plugins``: what is installed, its hooks and options.

A command plugin (``coretrain.commands``) on the public API, as pytest's ``--trace-config`` is its
``helpconfig`` plugin: ``coretrain.discover`` is what is installed, ``coretrain.hooks_of`` what a
plugin implements."""

from __future__ import annotations

import argparse
from importlib.metadata import entry_points
from typing import Any

import coretrain

COMMANDS_GROUP = "coretrain.commands"


def add(commands: Any) -> None:
    """Add this module's command(s) to ``coretrain``'s subcommands."""
    plugins = commands.add_parser("plugins", help="list installed plugins, their hooks and config fields")
    plugins.add_argument("names", nargs="*", metavar="NAME", help="only these plugins (default: all, and commands)")
    plugins.set_defaults(handler=cmd_plugins)


def cmd_plugins(args: argparse.Namespace) -> int:
    installed = coretrain.discover()
    for name in args.names:
        if name not in installed:
            raise coretrain.UserError(
                f"no plugin '{name}' is installed{coretrain.did_you_mean(name, installed)}; "
                "`coretrain plugins` lists all"
            )
    if not args.names:
        print(f"{len(installed)} plugins installed (entry-point group 'coretrain'):\n")
    for name in args.names or sorted(installed):
        entry = installed[name]
        try:
            cls = entry.load()
        except coretrain.UserError as exc:
            print(f"{name}  {entry.origin}  broken: {exc}\n")
            continue
        _print_plugin(name, entry, cls)
    if not args.names:
        _print_commands()
    return 0


def _print_plugin(name: str, entry: Any, cls: type) -> None:
    """Name, origin, how it is turned on, first doc line, hooks, options with defaults and docs."""
    import attrs  # (here, not at import: every `coretrain` command line loads this module)

    hooks = coretrain.hooks_of(cls)
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
    docs, defaults = field_docs(cls), coretrain.field_defaults(cls)
    for f in (f for f in attrs.fields(cls) if f.init):
        default = repr(defaults[f.name]) if f.name in defaults else "required"
        type_name = getattr(f.type, "__name__", None) or str(f.type)
        print(f"    {f.name}: {type_name} = {default}" + (f"  {docs[f.name]}" if f.name in docs else ""))
    print()


def _print_commands() -> None:
    """The commands, and which distribution adds each (a command plugin is removable too)."""
    points = sorted(entry_points(group=COMMANDS_GROUP), key=lambda p: p.name)
    print(f"{len(points)} commands (entry-point group '{COMMANDS_GROUP}'):")
    for point in points:
        origin = f"{point.dist.name} {point.dist.version}" if point.dist else "?"
        print(f"  {point.name}  {origin}  {point.value}")


def field_docs(cls: type) -> dict[str, str]:
    """First line of each field's attribute docstring, read from the class source."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    docs: dict[str, str] = {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = following.value.value.strip().splitlines()[0]
    return docs
