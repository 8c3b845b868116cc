"""``coretrain run CONFIG``: train, in this process or as one rank under torchrun (the launch flags,
``--nproc-per-node`` and the rest, come from the ``launch`` command module of coretrain-plugins).

Errors: a user mistake is one ``error:`` line (exit 2); any other failure is one line naming
the plugin or the exception, with the traceback written to the output dir (exit 1).
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import signal
import sys
import time
from typing import Any

from coretrain.commands.common import add_config_args


def add(commands: Any) -> None:
    """Add this module's command(s) to ``coretrain``'s subcommands."""
    run = commands.add_parser("run", help="train as the config says (works under torchrun too)")
    add_config_args(run)
    loudness = run.add_mutually_exclusive_group()
    for flags, level in ((("-q", "--quiet"), "warning"), (("-v", "--verbose"), "debug")):
        what = "only warnings and errors, no progress output" if level == "warning" else "debug messages too"
        loudness.add_argument(
            *flags, action="store_const", const=level, dest="log_level", help=f'{what} (run.log_level = "{level}")'
        )
    run.add_argument(
        "--traceback",
        action="store_true",
        help="when a plugin or the run fails, print the full traceback on stderr too "
        "(it is always written to OUTPUT_DIR/traceback.log)",
    )
    run.set_defaults(handler=cmd_run, own_signals=True)  # the start-up Ctrl-C handler stays until the watcher


def cmd_run(args: argparse.Namespace) -> int:
    """``coretrain run``: the exit code. The signal watcher comes first, so a Ctrl-C or a
    scheduler's SIGTERM during the seconds of start-up ends it cleanly (128 + signum), with
    nothing half-written."""
    from coretrain.signals import Interrupted, SignalWatcher

    signals = SignalWatcher().install()  # before torch is imported: no signal is lost in start-up
    try:
        return _train(args, signals)
    except Interrupted as exc:
        name = signal.Signals(exc.signum).name
        logging.getLogger("coretrain").info("stopped by %s during start-up; nothing was trained or saved", name)
        return 128 + exc.signum
    finally:
        signals.uninstall()


def _train(args: argparse.Namespace, signals: Any) -> int:
    """Load the config and plugins, then run the session. A user error is said once per machine;
    a failure of a plugin or of the run is one line here, its traceback in a file (written by
    ``on_error`` while the failing frames still exist)."""
    from coretrain.configload import load_config
    from coretrain.errors import FAILURE_EXIT_CODE, USAGE_EXIT_CODE, PluginError, RunFailure, UserError, summary
    from coretrain.session import session_plugins

    try:  # mistakes of the config and the installed packages, the same on every rank of a machine
        loaded = load_config(args.config, args.overrides)
        setup_console(args.log_level or loaded.config.run.log_level)
        signals.check()
        plugins = session_plugins(loaded)
    except UserError:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            raise  # under torchrun, local rank 0 says it: one line per machine, not one per rank
        wait_for_rank_0_to_say_it()
        return USAGE_EXIT_CODE
    signals.check()

    from coretrain.session import run_session
    from coretrain.signals import Interrupted

    written: list[str] = []

    def traceback_of(exc: BaseException) -> None:  # a plugin's or the core's failure: its traceback in a file
        if isinstance(exc, Exception) and not isinstance(exc, (UserError, RunFailure, Interrupted)):
            written.append(_write_traceback(loaded.config.output_dir, exc, args.traceback))

    freeze_the_heap()
    try:
        code, _ = run_session(loaded, plugins, signals, on_error=traceback_of)
    except Exception as exc:
        if not written:
            raise
        print(f"error: {str(exc) if isinstance(exc, PluginError) else summary(exc)}", file=sys.stderr)
        print(f"  full traceback: {written[0]}", file=sys.stderr)
        return FAILURE_EXIT_CODE
    return code


@functools.cache
def freeze_the_heap() -> None:
    """Once per process, before a run exists: what the imports made (torch's optimizers import
    ``torch._dynamo`` in every run: it comes now) moves where collections skip it, so the
    collections of a run's cycles at its end (``dist.shutdown``) walk what the run made, not
    300,000 objects (0.1–0.3 s each, twice a run). The CLI owns its process; ``coretrain.train``'s
    caller owns theirs: a frozen object of theirs in a cycle would never be collected. (No
    collection first: the imports leave about 80 objects of garbage, not worth 0.16 s. Asked once:
    ``gc.get_freeze_count`` walks every frozen object, 25 ms a time.)"""
    if not gc.get_freeze_count():
        import torch._dynamo  # noqa: F401

        gc.freeze()


def setup_console(level_name: str) -> None:
    """The console: rank 0 at ``level_name``, other ranks warnings and errors only, each line
    saying who wrote it (the ``console-log`` plugin sends libraries' lines to run.log)."""
    rank = int(os.environ.get("RANK", "0"))
    level = getattr(logging, level_name.upper())
    console = logging.StreamHandler(sys.stderr)
    console.set_name("coretrain-console")
    console.setLevel(level if rank == 0 else max(level, logging.WARNING))
    who = "coretrain" if rank == 0 else f"coretrain[rank {rank}]"
    console.setFormatter(logging.Formatter(f"{who}: %(message)s"))
    logging.basicConfig(level=level, force=True, handlers=[console])


QUIET_RANK_WAIT_SECONDS = 10.0
"""How long a rank that leaves a start-up mistake to local rank 0 waits for the launcher to end it."""


def wait_for_rank_0_to_say_it() -> None:
    """A rank that leaves the mistake to local rank 0 leaves after it: rank 0's exit ends this
    rank (the launcher's SIGTERM). Leaving first had the launcher stop rank 0 before it could say
    anything (seen under load); the wait is bounded, should rank 0 go on."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(QUIET_RANK_WAIT_SECONDS)


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
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"--- {now} pid {os.getpid()}\n{text}")
    except (OSError, ValueError):  # ValueError: a path the OS cannot take (a NUL byte in it)
        if not to_stderr:
            print(text, file=sys.stderr, end="")
        return "stderr (the output dir is not writable)"
    return str(path)
