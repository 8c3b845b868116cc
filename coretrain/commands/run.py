"""``coretrain run CONFIG``: train, in this process, under torchrun, or as torchrun's launcher.

Errors: a user mistake is one ``error:`` line (exit 2); any other failure is one line naming
the plugin or the exception, with the traceback written to the output dir (exit 1).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from coretrain.commands.common import add_config_args


def add(commands: Any) -> None:
    """Add this module's command(s) to ``coretrain``'s subcommands."""
    run = commands.add_parser("run", help="train as the config says (works under torchrun too)")
    add_config_args(run)
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
