"""``coretrain config validate | show``: check a config, or print it resolved with the defaults it changes."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import tomli_w

from coretrain.commands.common import add_config_args


def add(commands: Any) -> None:
    """Add this module's command(s) to ``coretrain``'s subcommands."""
    config = commands.add_parser("config", help="inspect a config file")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    show = config_commands.add_parser("show", help="print the resolved config; non-default values are marked")
    add_config_args(show)
    show.set_defaults(handler=cmd_config_show)
    validate = config_commands.add_parser("validate", help="check a config (and its plugins' tables) without training")
    add_config_args(validate)
    validate.set_defaults(handler=cmd_config_validate)


def cmd_config_validate(args: argparse.Namespace) -> int:
    from coretrain.config import micro_batches_per_step, world_size_from_env
    from coretrain.configload import load_config
    from coretrain.pluginmanager import load_plugins

    loaded = load_config(args.config, args.overrides)
    plugins = load_plugins(loaded.config, loaded.locations)
    micro_batches_per_step(loaded.config.train, world_size_from_env(), warn=False)  # the batch error first
    names = plugins.names()
    from coretrain.build import build_run, planned_steps

    # every check `run` makes before its first step (providers imported, their options, the splits,
    # the model, a fresh run's plan of steps), without writing anything
    planned_steps(build_run(loaded.config, plugins, write_config=False))
    print(f"{args.config}: ok ({len(names)} plugins enabled: {', '.join(names) or 'none'})")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from coretrain.config import Config
    from coretrain.configload import CONVERTER, load_config
    from coretrain.pluginmanager import field_defaults, load_plugins

    loaded = load_config(args.config, args.overrides)
    plugins = load_plugins(loaded.config, loaded.locations)
    resolved = CONVERTER.unstructure(loaded.config)
    defaults = CONVERTER.unstructure(Config())
    for name in plugins.names():
        instance = plugins.get(name)
        cls = type(instance)
        table = CONVERTER.unstructure(instance)
        default = field_defaults(cls)
        section = next((s for s in ("model", "data") if getattr(loaded.config, s).provider == name), None)
        if section:
            resolved[section]["options"], defaults[section]["options"] = table, default
        else:
            resolved["plugins"][name], defaults["plugins"][name] = table, default
    print(
        f"# {args.config} resolved ({'extends, ' if 'extends' in loaded.path.read_text() else ''}--set applied); "
        "'# default: ...' marks values you changed"
    )
    print(annotated_toml(resolved, defaults), end="")
    if plugins.implemented("param_group_overrides"):
        print()
        print(describe_param_groups(loaded.config, plugins))
    return 0


def describe_param_groups(config: Any, plugins: Any) -> str:
    """Build the model and optimizer (no files written) and list the param groups as comments."""
    from coretrain.build import build_run

    run = build_run(config, plugins, write_config=False)
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
    line = f"# {_key(name)} = (unset)" if obj is None else f"{_key(name)} = {_value(obj)}"
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
