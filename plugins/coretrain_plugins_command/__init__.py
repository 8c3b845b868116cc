"""``coretrain plugins``: what is installed, its hooks and options.

A command of coretrain-plugins, as pytest's ``--version`` and ``--trace-config`` come from its
built-in ``helpconfig`` plugin: the core lists nothing itself. It reads what any tool could:
the entry-point groups (``coretrain``, ``coretrain.autoload``, ``coretrain.commands``) and each
plugin's class (its ``@coretrain.hookimpl`` methods, its attrs fields and their docstrings).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import textwrap
from importlib.metadata import EntryPoint, entry_points
from typing import Any

PLUGINS_GROUP = "coretrain"
AUTOLOAD_GROUP = "coretrain.autoload"
COMMANDS_GROUP = "coretrain.commands"
INSTALL_HINT = "install one, e.g. `pip install -e ./plugins` for the first-party plugins"


def add(commands: Any) -> None:
    """Add this module's command(s) to ``coretrain``'s subcommands."""
    plugins = commands.add_parser("plugins", help="list installed plugins, their hooks and config fields")
    plugins.set_defaults(handler=cmd_plugins)


def cmd_plugins(args: argparse.Namespace) -> int:
    installed = {point.name: point for point in entry_points(group=PLUGINS_GROUP)}
    if not installed:
        print(f"No coretrain plugins installed; {INSTALL_HINT}.")
        return 0
    autoload = {point.name for point in entry_points(group=AUTOLOAD_GROUP)}
    print(f"{len(installed)} plugins installed (entry-point group '{PLUGINS_GROUP}'):\n")
    for name, point in sorted(installed.items()):
        try:
            cls = point.load()
        except Exception as exc:  # a broken plugin is listed as such; the others still are
            print(f"{name}  {origin(point)}  broken: {type(exc).__name__}: {exc}\n")
            continue
        _print_plugin(name, point, cls, name in autoload)
    _print_commands()
    return 0


def origin(point: EntryPoint) -> str:
    return f"{point.dist.name} {point.dist.version}" if point.dist else "?"


def hooks_of(cls: type) -> list[str]:
    """The hooks a plugin class implements: its methods with the ``coretrain`` hookimpl marker."""
    return sorted(name for name, member in inspect.getmembers(cls) if hasattr(member, "coretrain_impl"))


def _print_plugin(name: str, point: EntryPoint, cls: type, autoload: bool) -> None:
    """Name, origin, how it is turned on, first doc line, hooks, options with defaults and docs."""
    import attrs

    from coretrain import field_defaults

    hooks = hooks_of(cls)
    if providers := [h for h in hooks if h.startswith("provide_")]:
        section = "model" if "provide_model" in providers else "data"
        state = f'provider: set {section}.provider = "{name}", options in [{section}.options]'
    else:
        state = "on by default (disable: enabled = false)" if autoload else f"off unless configured: [plugins.{name}]"
    print(f"{name}  {origin(point)}  {state}")
    if doc := (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "":
        print(f"  {doc}")
    print(f"  hooks: {', '.join(hooks) or '(none)'}")
    if not attrs.has(cls):
        print("  not an attrs class: a plugin is an @attrs.define class whose fields are its config\n")
        return
    docs, defaults = field_docs(cls), field_defaults(cls)
    for f in (f for f in attrs.fields(cls) if f.init):
        default = repr(defaults[f.name]) if f.name in defaults else "required"
        type_name = getattr(f.type, "__name__", None) or str(f.type)
        first_line = f"  {docs[f.name].splitlines()[0]}" if docs.get(f.name) else ""
        print(f"    {f.name}: {type_name} = {default}{first_line}")
    print()


def _print_commands() -> None:
    """The commands, and which distribution adds each (a command plugin is removable too)."""
    points = sorted(entry_points(group=COMMANDS_GROUP), key=lambda p: p.name)
    print(f"{len(points)} commands (entry-point group '{COMMANDS_GROUP}'):")
    for point in points:
        print(f"  {point.name}  {origin(point)}  {point.value}")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of an attrs class (a string literal right after it), read
    from the class's source (the reference pages of the docs read them here too)."""
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
            docs[node.target.id] = inspect.cleandoc(following.value.value)
    return docs
