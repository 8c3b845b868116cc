"""``coretrain config validate | show``: check a config, or print it resolved with the defaults it changes.

A command plugin (``coretrain.commands``), on the public API: ``coretrain.prepare`` is every check a
run makes before its first step, ``coretrain.load`` / ``load_plugins`` the config and its plugins.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import tomli_w

import coretrain


def add(commands: Any) -> None:
    """Add ``config show | validate`` to ``coretrain``'s subcommands."""
    config = commands.add_parser("config", help="inspect a config file")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    show = config_commands.add_parser("show", help="print the resolved config; non-default values are marked")
    coretrain.add_config_args(show)
    show.set_defaults(handler=cmd_config_show)
    validate = config_commands.add_parser("validate", help="check a config (and its plugins' tables) without training")
    coretrain.add_config_args(validate)
    validate.set_defaults(handler=cmd_config_validate)


def cmd_config_validate(args: argparse.Namespace) -> int:
    # every check `run` makes before its first step (the layout and batch for these ranks, providers
    # imported, their options, the splits, the model, a fresh run's plan of steps), writing nothing
    run = coretrain.prepare(args.config, args.overrides)
    names = run.plugins.names()
    print(f"{args.config}: ok ({len(names)} plugins enabled: {', '.join(names) or 'none'})")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    loaded = coretrain.load(args.config, args.overrides)
    plugins = coretrain.load_plugins(loaded)
    resolved = coretrain.config_as_dict(loaded.config)
    defaults = declared_defaults(loaded.config, resolved)
    for name in plugins.names():
        instance = plugins.get(name)
        table, default = coretrain.config_as_dict(instance), coretrain.field_defaults(type(instance))
        section = next((s for s in ("model", "data") if getattr(loaded.config, s).provider == name), None)
        if section:
            resolved[section]["options"], defaults[section]["options"] = table, default
        else:
            resolved["plugins"][name], defaults["plugins"][name] = table, default
    print(
        f"# {args.config} resolved{applied(loaded.path.read_text(), args.overrides)}; "
        "'# default: ...' marks values you changed"
    )
    print(annotated_toml(resolved, defaults), end="")
    if plugins.implemented("param_group_overrides"):
        print()
        print(describe_param_groups(coretrain.prepare(args.config, args.overrides)))
    return 0


def applied(text: str, overrides: list[str]) -> str:
    """What the resolved config took besides the file: " (extends, --set applied)", or ""."""
    parts = [name for name, used in (("extends", "extends" in text), ("--set", bool(overrides))) if used]
    return f" ({', '.join(parts)} applied)" if parts else ""


def declared_defaults(config: Any, resolved: dict[str, Any]) -> dict[str, Any]:
    """Each section's defaults as its fields declare them — not as a config with nothing set
    resolves them (there train_iters, unset by default, became 1000: a stale "default: 1000")."""
    defaults: dict[str, Any] = {}
    for section, values in resolved.items():
        part = getattr(config, section, None)
        if isinstance(values, dict) and part is not None and hasattr(type(part), "__attrs_attrs__"):
            defaults[section] = coretrain.field_defaults(type(part))
    defaults.setdefault("plugins", {})
    return defaults


def describe_param_groups(run: coretrain.Run) -> str:
    """The optimizer's param groups of a built run (no files written), as comments."""
    names = {id(p): n for n, p in run.unwrapped_model.named_parameters()}
    lines = [f"# optimizer param groups ({len(run.optimizer.param_groups)}):"]
    for i, group in enumerate(run.optimizer.param_groups):
        params = group["params"]
        count = sum(p.numel() for p in params)
        settings = ", ".join(f"{k} = {group[k]:g}" for k in ("lr_mult", "weight_decay", "max_lr", "min_lr"))
        examples = ", ".join(names[id(p)] for p in params[:3]) + (", ..." if len(params) > 3 else "")
        lines.append(f"#   group {i}: {len(params)} tensors, {count:,} parameters; {settings}")
        lines.append(f"#     {examples}")
    return "\n".join(lines)


_NO_DEFAULT = object()


def annotated_toml(data: Mapping[str, Any], defaults: Mapping[str, Any]) -> str:
    """Scalars of a table first, then each sub-table under its own ``[a.b]`` header; unset values
    appear as comments and each value that differs from its default says what the default was."""
    return "\n\n".join(block.rstrip("\n") for block in _blocks(data, defaults, ()) if block.strip()) + "\n"


def _blocks(data: Mapping[str, Any], defaults: Mapping[str, Any], path: tuple[str, ...]) -> list[str]:
    lines = [_line(k, v, defaults) for k, v in data.items() if not isinstance(v, Mapping)]
    blocks = []
    if lines or (path and not data):
        header = "[" + ".".join(_key(p) for p in path) + "]\n" if path else ""
        blocks.append(header + "\n".join(lines))
    for k, v in data.items():
        if isinstance(v, Mapping):
            sub = defaults.get(k, {})
            blocks += _blocks(v, sub if isinstance(sub, Mapping) else {}, (*path, k))
    return blocks


def _line(name: str, obj: Any, defaults: Mapping[str, Any]) -> str:
    if obj is None:  # unset: no default to mark (train_iters' 1000 is only what a run counted by nothing else takes)
        return f"# {_key(name)} = (unset)"
    line = f"{_key(name)} = {_value(obj)}"
    default = defaults.get(name, _NO_DEFAULT)
    if default is _NO_DEFAULT:
        return line + "  # set (no default)"
    if default != obj:
        return line + f"  # default: {'(unset)' if default is None else _value(default)}"
    return line


def _key(name: str) -> str:
    return tomli_w.dumps({name: 0}).rsplit(" = ", 1)[0]


def _value(obj: Any) -> str:
    """One line, as a user writes it (tomli-w spreads arrays over lines)."""
    if isinstance(obj, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in obj if x is not None) + "]"
    if isinstance(obj, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in obj.items() if v is not None) + "}"
    return tomli_w.dumps({"v": obj}).split(" = ", 1)[1].strip()
