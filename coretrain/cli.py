"""Command line: ``coretrain run | checkpoint | report | plugins | new-plugin | config show | config validate``.

Only argparse is imported at module level, so ``coretrain --help`` starts fast and never
imports torch; each command imports what it needs. A :class:`UserError` from anywhere
becomes one ``error:`` line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from coretrain import __version__


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a config value (TOML syntax; repeatable), e.g. --set optimizer.lr=3e-4",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coretrain", description="Train PyTorch models; every feature is a plugin.")
    parser.add_argument("--version", action="version", version=f"coretrain {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="train as the config says (works under torchrun too)")
    _add_config_args(run)
    run.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="start N ranks on this machine through torchrun (same as `torchrun --standalone "
        "--nproc-per-node N -m coretrain run CONFIG`)",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="with --nproc-per-node: restart the ranks up to K times after a failure; "
        "each restart resumes from the newest complete checkpoint",
    )
    loudness = run.add_mutually_exclusive_group()
    loudness.add_argument(
        "-q",
        "--quiet",
        action="store_const",
        const="warning",
        dest="log_level",
        help='only warnings and errors (run.log_level = "warning"); no progress output',
    )
    loudness.add_argument(
        "-v",
        "--verbose",
        action="store_const",
        const="debug",
        dest="log_level",
        help='debug messages too (run.log_level = "debug")',
    )
    run.add_argument(
        "--traceback",
        action="store_true",
        help="when a plugin or the run fails, print the full traceback on stderr too "
        "(it is always written to OUTPUT_DIR/traceback.log)",
    )
    run.set_defaults(handler=cmd_run)

    ckpt = commands.add_parser("checkpoint", help="inspect and export a run's checkpoints")
    ckpt_commands = ckpt.add_subparsers(dest="checkpoint_command", required=True, metavar="SUBCOMMAND")
    listing = ckpt_commands.add_parser("list", help="steps, sizes, complete or not")
    listing.add_argument("run_dir", help="the run's output dir (holds checkpoints/)")
    listing.set_defaults(handler=cmd_checkpoint_list)
    export = ckpt_commands.add_parser("export", help="model weights of a checkpoint as .safetensors")
    export.add_argument("run_dir", help="the run's output dir (holds checkpoints/)")
    export.add_argument("--step", type=int, default=None, help="which step (default: newest complete)")
    export.add_argument("--to", required=True, help="output file, e.g. model.safetensors")
    export.set_defaults(handler=cmd_checkpoint_export)

    report = commands.add_parser(
        "report",
        help="plot a run's metrics (PNG files) and print a summary; several runs: overlaid, with a comparison table",
    )
    report.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="a run's output dir (holds metrics.jsonl)")
    report.add_argument(
        "--metrics", default=None, metavar="FILE", help="read this file instead of RUN_DIR/metrics.jsonl"
    )
    report.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where the PNGs go (default: RUN_DIR/report; several runs: FIRST_RUN_DIR/report/compare)",
    )
    report.set_defaults(handler=cmd_report)

    plugins = commands.add_parser("plugins", help="list installed plugins, their hooks and config fields")
    plugins.set_defaults(handler=cmd_plugins)

    scaffold = commands.add_parser(
        "new-plugin", help="write a plugin package (entry point, one option, one hook, a test) ready to pip install"
    )
    scaffold.add_argument("name", help="the plugin's name, e.g. loss-spikes (enabled by [plugins.loss-spikes])")
    scaffold.add_argument("--dir", default=None, metavar="D", help="where to write it (default: ./coretrain-NAME)")
    scaffold.set_defaults(handler=cmd_new_plugin)

    config = commands.add_parser("config", help="inspect a config file")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    show = config_commands.add_parser("show", help="print the resolved config; non-default values are marked")
    _add_config_args(show)
    show.set_defaults(handler=cmd_config_show)
    validate = config_commands.add_parser("validate", help="check a config (and its plugins' tables) without training")
    _add_config_args(validate)
    validate.set_defaults(handler=cmd_config_validate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m coretrain` does: ./mymodule:build
        sys.path.insert(0, os.getcwd())
    from coretrain.errors import FAILURE_EXIT_CODE, USAGE_EXIT_CODE, RunFailure, UserError

    try:
        return int(args.handler(args) or 0)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except RunFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return FAILURE_EXIT_CODE
    except KeyboardInterrupt:  # before the run's own handler was installed
        print("error: interrupted", file=sys.stderr)
        return 130


# --------------------------------------------------------------------------- commands


def _setup_logging(level_name: str = "info") -> None:
    """The console: rank 0 at ``level_name``, other ranks warnings and errors only; Python warnings
    (from libraries coretrain calls) through the same handler, each distinct one once."""
    import warnings

    rank = int(os.environ.get("RANK", "0"))
    level = getattr(logging, level_name.upper())
    logging.basicConfig(
        level=level if rank == 0 else max(level, logging.WARNING),
        force=True,
        format="coretrain: %(message)s" if rank == 0 else f"coretrain[rank {rank}]: %(message)s",
    )
    warnings.simplefilter("once")
    logging.captureWarnings(True)
    logging.getLogger("py.warnings").addFilter(_OnceEach())


class _OnceEach(logging.Filter):
    """Pass each distinct warning (category and text, wherever it was raised) once.

    Python's "once" filter is undone by libraries that warn inside ``catch_warnings`` blocks
    with filters of their own; a warning raised every step would then reach the console again."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        first = record.getMessage().splitlines()[0] if record.getMessage() else ""
        key = first.split(": ", 1)[-1]  # "path:line: Category: text" -> "Category: text"
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


def launch_torchrun(args: argparse.Namespace) -> int:
    """Run this command under torchrun in this process; its exit code mirrors the job's.

    torchrun itself answers a SIGTERM with a traceback and exit 1; here the job exits with
    128+signum, like a single-process run, once the ranks have checkpointed.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    # Workers keep their own rendezvous store: with the agent's shared store, restarted gloo
    # groups connect to the dead attempt's ports (seen with torch 2.13; pytorch#167288).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    argv = [
        "--standalone",
        "--nproc-per-node",
        str(args.nproc_per_node),
        "--max-restarts",
        str(args.max_restarts),
        "-m",
        "coretrain",
        "run",
        args.config,
    ]
    for override in args.overrides:
        argv += ["--set", override]
    try:
        torchrun(argv)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        print(f"error: rank {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    if args.nproc_per_node and "LOCAL_RANK" not in os.environ:
        return launch_torchrun(args)
    from coretrain.signals import Interrupted, SignalWatcher

    signals = SignalWatcher().install()  # before torch is imported: no signal is lost in start-up
    try:
        return _train(args, signals)
    except Interrupted as exc:
        import signal

        logging.getLogger("coretrain").info(
            "stopped by %s during start-up; nothing was trained or saved", signal.Signals(exc.signum).name
        )
        return 128 + exc.signum
    finally:
        signals.uninstall()


def _train(args: argparse.Namespace, signals: Any) -> int:
    from coretrain.configload import load_config
    from coretrain.pluginmanager import load_plugins

    loaded = load_config(args.config, args.overrides)
    _setup_logging(args.log_level or loaded.config.run.log_level)
    signals.check()
    plugins = load_plugins(loaded.config, loaded.locations)
    signals.check()

    from coretrain import dist
    from coretrain.errors import FAILURE_EXIT_CODE, PluginError, RunFailure, UserError
    from coretrain.loop import Trainer
    from coretrain.run import build_run
    from coretrain.signals import Interrupted

    try:
        code = Trainer(build_run(loaded.config, plugins, signals=signals), signals).train()
    except (UserError, RunFailure, Interrupted, KeyboardInterrupt):
        dist.shutdown()
        raise
    except Exception as exc:  # a plugin's or the core's failure: one line here, the traceback in a file
        dist.shutdown()
        where = _write_traceback(loaded.config.output_dir, exc, args.traceback)
        first = next((line for line in str(exc).splitlines() if line.strip()), "")
        message = str(exc) if isinstance(exc, PluginError) else f"{type(exc).__name__}: {first}"
        print(f"error: {message}", file=sys.stderr)
        print(f"  full traceback: {where}", file=sys.stderr)
        return FAILURE_EXIT_CODE
    dist.shutdown(graceful=True)
    return code


def _write_traceback(output_dir: str, exc: BaseException, to_stderr: bool) -> str:
    """Append the traceback to OUTPUT_DIR/traceback.log (rank N: traceback.rankN.log); where it went."""
    import datetime
    import traceback
    from pathlib import Path

    text = "".join(traceback.format_exception(exc))
    if to_stderr:
        print(text, file=sys.stderr, end="")
    rank = int(os.environ.get("RANK", "0"))
    path = Path(output_dir) / ("traceback.log" if rank == 0 else f"traceback.rank{rank}.log")
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(
                f"--- {datetime.datetime.now().astimezone().isoformat(timespec='seconds')} pid {os.getpid()}\n{text}"
            )
    except OSError:
        if not to_stderr:
            print(text, file=sys.stderr, end="")
        return "stderr (the output dir is not writable)"
    return str(path)


def cmd_checkpoint_list(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coretrain.export import list_checkpoints

    found = list_checkpoints(Path(args.run_dir))
    latest = Path(args.run_dir) / "checkpoints" / "latest"
    newest = latest.read_text().strip() if latest.exists() else "-"
    print(f"{'step':>10}  {'size':>10}  state       path")
    for info in found:
        state = "complete" if info.complete else "incomplete"
        print(f"{info.step:>10}  {info.size_bytes / 2**20:>8.1f}MB  {state:<10}  {info.path}")
    print(f"{len(found)} checkpoint(s); {sum(i.complete for i in found)} complete; latest: {newest}")
    return 0


def cmd_checkpoint_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coretrain.export import export_weights

    source = export_weights(Path(args.run_dir), args.step, Path(args.to))
    print(f"wrote {args.to} from {source}")
    return 0


def cmd_config_validate(args: argparse.Namespace) -> int:
    from coretrain.config import micro_batches_per_step, world_size_from_env
    from coretrain.configload import load_config
    from coretrain.pluginmanager import load_plugins

    loaded = load_config(args.config, args.overrides)
    plugins = load_plugins(loaded.config, loaded.locations)
    micro_batches_per_step(loaded.config.train, world_size_from_env())
    names = plugins.names()
    from coretrain.run import build_run

    # every check `run` makes before its first step (providers imported, their options, the splits,
    # the model), without writing anything
    build_run(loaded.config, plugins, write_config=False)
    print(f"{args.config}: ok ({len(names)} plugins enabled: {', '.join(names) or 'none'})")
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    from coretrain.config import Config
    from coretrain.configload import CONVERTER, load_config
    from coretrain.pluginmanager import load_plugins

    loaded = load_config(args.config, args.overrides)
    plugins = load_plugins(loaded.config, loaded.locations)
    resolved = CONVERTER.unstructure(loaded.config)
    defaults = CONVERTER.unstructure(Config())
    for name in plugins.names():
        instance = plugins.get(name)
        cls = type(instance)
        table = CONVERTER.unstructure(instance)
        default = _defaults_of(cls)
        section = next((s for s in ("model", "data") if getattr(loaded.config, s).provider == name), None)
        if section:
            resolved[section]["options"], defaults[section]["options"] = table, default
        else:
            resolved["plugins"][name], defaults["plugins"][name] = table, default
    print(
        f"# {args.config} resolved ({'extends, ' if 'extends' in loaded.path.read_text() else ''}--set applied); "
        "'# default: ...' marks values you changed"
    )
    print(render_annotated(resolved, defaults))
    if plugins.implemented("param_group_overrides"):
        print()
        print(describe_param_groups(loaded.config, plugins))
    return 0


def describe_param_groups(config: Any, plugins: Any) -> str:
    """Build the model and optimizer (no files written) and list the param groups as comments."""
    from coretrain.run import build_run

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


def _defaults_of(cls: type) -> dict[str, Any]:
    import attrs

    from coretrain.configload import CONVERTER

    values = {}
    for f in attrs.fields(cls):
        if f.default is attrs.NOTHING or not f.init:
            continue
        default = (
            f.default.factory() if isinstance(f.default, attrs.Factory) and not f.default.takes_self else f.default  # type: ignore[arg-type]  # attrs.Factory is a class at run time
        )
        values[f.name] = CONVERTER.unstructure(default)
    return values


_UNSET = object()


def render_annotated(data: dict[str, Any], defaults: dict[str, Any], prefix: tuple[str, ...] = ()) -> str:
    """TOML of ``data`` where each value that differs from ``defaults`` says what the default was."""
    from coretrain.tomlwrite import key, value

    lines = []
    for k, v in data.items():
        if isinstance(v, dict):
            continue
        default = defaults.get(k, _UNSET) if isinstance(defaults, dict) else _UNSET
        if v is None:
            line = f"# {key(k)} = (unset)"
        else:
            line = f"{key(k)} = {value(v)}"
        if default is _UNSET:
            line += "  # set (no default)"
        elif default != v:
            line += f"  # default: {'(unset)' if default is None else value(default)}"
        lines.append(line)
    blocks = []
    if prefix and (lines or not any(isinstance(v, dict) for v in data.values())):
        blocks.append("[" + ".".join(key(p) for p in prefix) + "]\n" + "\n".join(lines))
    elif lines:
        blocks.append("\n".join(lines))
    for k, v in data.items():
        if isinstance(v, dict):
            sub_defaults = defaults.get(k, {}) if isinstance(defaults, dict) else {}
            blocks.append(render_annotated(v, sub_defaults if isinstance(sub_defaults, dict) else {}, (*prefix, k)))
    return "\n\n".join(b.rstrip() for b in blocks if b.strip())


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coretrain.report import report

    return report(
        [Path(d) for d in args.run_dirs],
        Path(args.metrics) if args.metrics else None,
        Path(args.out) if args.out else None,
    )


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
    from coretrain.pluginmanager import INSTALL_HINT, discover, field_docs, hooks_of

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
        defaults = _defaults_of(cls)
        for f in (f for f in attrs.fields(cls) if f.init):
            default = repr(defaults[f.name]) if f.name in defaults else "required"
            type_name = getattr(f.type, "__name__", None) or str(f.type)
            console.print(
                f"    {f.name}: {escape(type_name)} = {escape(default)}"
                + (f"  [dim]{escape(docs[f.name])}[/]" if f.name in docs else "")
            )
        console.print()
    return 0
