"""``coretrain run --nproc-per-node N [--nnodes ...]``: torchrun's launcher, in this process.

This command module adds no command of its own: it gives ``run`` the launch flags (a
``coretrain.commands`` module may extend a command the core registered before it), and with
them ``run`` starts the ranks under ``torch.distributed.run`` instead of training itself. The
ranks run the plain ``coretrain run CONFIG``; ``torchrun -m coretrain run`` works without it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from coretrain import UserError
from coretrain_launch.codes import STOP_CODES, USAGE_EXIT_CODE

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from coretrain_launch.hookspecs import LaunchSpecs

Handler = Callable[[argparse.Namespace], int]


def add(commands: Any) -> None:
    """Give ``coretrain run`` the launch flags; leave it as it is when not launching."""
    run = commands.choices.get("run")
    if run is None:
        return
    launch = run.add_argument_group(
        "launching ranks (torchrun's launcher, in this process; run the same command on every machine)"
    )
    launch.add_argument(
        "--nproc-per-node",
        type=whole_number(1),
        default=None,
        metavar="N",
        help="start N ranks on this machine (same as `torchrun --standalone --nproc-per-node N "
        "-m coretrain run CONFIG`); default 1 with --nnodes",
    )
    launch.add_argument(
        "--nnodes",
        default=None,
        metavar="N|MIN:MAX",
        help="machines in the job; MIN:MAX for an elastic job that starts with MIN, takes machines "
        "that join up to MAX and, given --max-restarts, goes on without one that leaves (each "
        "change stops the ranks with a checkpoint and restarts them from it)",
    )
    launch.add_argument(
        "--rdzv-endpoint",
        default=None,
        metavar="HOST:PORT",
        help="where the machines meet (with --nnodes): a free port on a host every machine reaches; "
        "that host's launcher keeps the meeting point, so it must stay up (one machine: its ranks "
        "meet there instead of on a port of their own)",
    )
    launch.add_argument(
        "--node-rank",
        type=whole_number(0),
        default=None,
        metavar="R",
        help="this machine's place, 0..N-1, with a fixed --nnodes N (ranks R*nproc ..); "
        "unset, machines are numbered as they arrive",
    )
    launch.add_argument(
        "--rdzv-id",
        default="coretrain",
        metavar="ID",
        help="the job's name at the endpoint, the same on every machine (default: coretrain)",
    )
    launch.add_argument(
        "--rdzv-conf",
        default=None,
        metavar="KEY=VALUE,...",
        help="rendezvous settings, as torchrun takes them (e.g. join_timeout=900,last_call_timeout=30)",
    )
    launch.add_argument(
        "--max-restarts",
        type=whole_number(0),
        default=0,
        metavar="K",
        help="restart the ranks up to K times after a failure; each restart resumes from the "
        "newest complete checkpoint",
    )
    launch.add_argument(
        "--replace-failed-ranks",
        action="store_true",
        help="with [plugins.inprocess-restart]: when a rank's process dies (SIGKILL, the OOM killer), "
        "start a new one in its place alone while the other ranks wait for it in-process (torchrun "
        "restarts every rank); each counts against --max-restarts. With --nnodes MIN:MAX and "
        "--rdzv-endpoint, a machine that joins or leaves changes the job in-process too",
    )
    launch.add_argument(
        "--min-ranks",
        type=whole_number(1),
        default=None,
        metavar="M",
        help="with --replace-failed-ranks: once no replacement is left, a rank that dies is dropped and "
        "the others go on in-process as a smaller job (the data-parallel size shrinks, the global batch "
        "kept by accumulation) while at least M ranks remain; default: every rank is needed",
    )
    run.set_defaults(handler=launching(run.get_default("handler")))


def whole_number(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``least`` (a rank count, a restart count)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = least - 1
        if value < least:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
        return value

    return parse


LAUNCHER_ONLY = ("replace_failed_ranks", "max_restarts", "min_ranks", "rdzv_endpoint", "node_rank")
"""Flags that mean something only when this command launches the ranks."""


def launching(run_here: Handler) -> Handler:
    def handler(args: argparse.Namespace) -> int:
        if (args.nproc_per_node or args.nnodes) and "LOCAL_RANK" not in os.environ:
            return launch_torchrun(args)
        given = [name for name in LAUNCHER_ONLY if getattr(args, name) not in (None, False, 0)]
        if given and "LOCAL_RANK" not in os.environ:
            flag = "--" + given[0].replace("_", "-")
            raise UserError(
                f"{flag}: only when coretrain starts the ranks; add --nproc-per-node N (this machine's ranks) "
                "or --nnodes (several machines)"
            )
        return run_here(args)

    return handler


def launch_torchrun(args: argparse.Namespace) -> int:
    """Run this command under torchrun in this process; its exit code mirrors the job's.

    torchrun itself answers a SIGTERM with a traceback and exit 1; here the job exits with
    128+signum, like a single-process run, once the ranks have checkpointed. A rank that ended
    that way stopped as agreed, not failed; a rendezvous that is gone (the machine hosting it
    left) is one error line, not the C++ stack torch's store logs.
    """
    argv = torchrun_arguments(args)  # a mistake in the flags is reported before torch loads
    quiet_torch_logging_here()
    import coretrain

    loaded = coretrain.load(args.config, args.overrides)  # a mistake: said once, before any rank starts
    plugins = coretrain.load_plugins(loaded)
    if plugins.implemented("launch_job"):  # a plugin that starts the job its own way (torchft's groups)
        hooks = cast("LaunchSpecs", plugins.calls.hook)
        code = hooks.launch_job(args=args, loaded=loaded, check=lambda sizes: check_job(loaded, sizes, plugins))
        if code is not None:
            return int(code)
    low, _, high = (args.nnodes or "1").partition(":")
    if high in ("", low):  # a fixed number of ranks: the layout and batch sizes must fit it
        check_job(loaded, [int(low) * (args.nproc_per_node or 1)], plugins)
    if args.min_ranks is not None and not args.replace_failed_ranks:
        raise UserError("--min-ranks: only with --replace-failed-ranks (coretrain's own launcher)")
    if args.replace_failed_ranks:
        return launch_own(args, [sys.executable, *argv[argv.index("-m") :]], loaded)
    if args.rdzv_endpoint:
        from coretrain_launch.endpoint import check_endpoint

        check_endpoint(args.rdzv_endpoint, args.rdzv_conf)
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun

    for handler in logging.getLogger("torch.distributed").handlers:  # torch's own, where elastic logs
        handler.addFilter(_AgreedStops())
    if args.max_restarts or argv[0] != "--standalone":  # (torchrun_arguments decided: one machine)
        # Workers the agent may start again keep their own rendezvous store: with the agent's
        # shared one, restarted gloo groups connect to the dead attempt's ports (seen with torch
        # 2.13; pytorch#167288). A job that cannot restart shares it, as torchrun does: rank 0's
        # own store would listen on a port the agent found free and let go, which another
        # process may take before rank 0 binds it (EADDRINUSE; torch's get_free_port says so).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        torchrun(argv)
    except SignalException as exc:
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        return child_failed(exc)
    except (RendezvousError, DistError) as exc:
        cause: BaseException = exc
        while cause.__cause__ is not None:  # torch's outer message says "see inner exception"
            cause = cause.__cause__
        first = next((line.strip() for line in str(cause).splitlines() if line.strip()), type(cause).__name__)
        print(
            f"error: lost the rendezvous at {args.rdzv_endpoint or 'this machine'} (did the machine hosting it "
            f"leave?): {first[:200]}",
            file=sys.stderr,
        )
        return 1
    return 0


def check_job(loaded: Any, sizes: list[int], plugins: Any = None) -> None:
    """Each number of ranks the job may have fits the config's layout and batch sizes — the
    core's keys and each enabled plugin's (``check_layout``): one error for the job. ``plugins``:
    the config's, when the caller loaded them already."""
    import coretrain

    plugins = plugins or coretrain.load_plugins(loaded)
    for ranks in sorted(sizes):
        loaded.config.check_world(ranks)
        if plugins.implemented("check_layout"):
            plugins.calls.hook.check_layout(config=loaded.config, world_size=ranks, hooks=plugins.calls.hook)


def launch_own(args: argparse.Namespace, command: list[str], loaded: Any) -> int:
    """coretrain's own launcher (``--replace-failed-ranks``), on one machine or across machines,
    once every size the job may shrink or grow to is checked against its batch."""
    from coretrain_launch.replacing import check_replacing, launch_replacing

    settings = loaded.config
    check_replacing(args, settings.plugins)
    nproc, (low, _, high) = args.nproc_per_node or 1, (args.nnodes or "1").partition(":")
    sizes = {machines * nproc for machines in range(int(low), int(high or low) + 1)}  # machines come and go
    if args.min_ranks is not None:  # ranks dropped one by one
        sizes |= set(range(args.min_ranks, int(high or low) * nproc + 1))
    check_job(loaded, sorted(sizes))
    if args.rdzv_endpoint:
        from coretrain_launch.machines import launch_machines

        return launch_machines(args, command, settings, child_failed)
    return launch_replacing(args, command, child_failed)


def child_failed(exc: ChildFailedError) -> int:
    """The job's exit code and one line for the ranks that failed (torch's ``ChildFailedError``)."""
    written = {rank: f for rank, f in exc.failures.items() if "timestamp" in f.error_file_data}  # by a rank
    verdicts = sorted((f.timestamp, rank, f) for rank, f in written.items())
    if verdicts:  # a rank wrote down why (the watchdog names the rank that froze): say that
        _, rank, failure = verdicts[0]
        print(f"error: {failure.message}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    # failures found in one look share a timestamp; torch names the first it found (a rank that
    # failed because its peer vanished, if its number is lower), unless a signal killed one: that
    # one (OOM, SIGKILL) is what the others failed from. SIGTERM is the launcher's own, at the end
    killed = {rank for rank, f in exc.failures.items() if f.exitcode < 0 and f.exitcode != -signal.SIGTERM}
    rank, failure = min(exc.failures.items(), key=lambda item: (item[1].timestamp, item[0] not in killed))
    if failure.exitcode == USAGE_EXIT_CODE:  # a mistake the rank has said in one line already
        return USAGE_EXIT_CODE
    if failure.exitcode in STOP_CODES:
        print(
            f"coretrain: rank {rank} stopped on {STOP_CODES[failure.exitcode]} after saving a checkpoint "
            f"(exit {failure.exitcode}); the job resumes from it",
            file=sys.stderr,
        )
        return failure.exitcode
    print(f"error: rank {rank} failed with exit code {failure.exitcode}", file=sys.stderr)
    return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode


class _AgreedStops(logging.Filter):
    """Drop torch elastic's lines that call an agreed, checkpointed stop a failure, or repeat a
    mistake a rank has said itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if any(f"(exitcode: {code})" in text for code in (*STOP_CODES, USAGE_EXIT_CODE)):
            return False
        return "has failed to shutdown the rendezvous" not in text


def quiet_torch_logging_here() -> None:
    """torch's C++ warnings off in this launcher (a store client's "sendBytes failed" with its
    C++ stack, when a machine leaves, would bury the one line the launcher says): read once, as
    torch loads, so set before the first import of torch; the ranks it starts log as the user
    asked (the variable is restored at once)."""
    if "torch" in sys.modules:
        return
    cpp_log_level = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    import torch  # noqa: F401

    _restore_env("TORCH_CPP_LOG_LEVEL", cpp_log_level)


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def torchrun_arguments(args: argparse.Namespace) -> list[str]:
    """torchrun's command line for this command's launch flags (one machine: --standalone;
    several: c10d rendezvous at --rdzv-endpoint, or torchrun's static one with --node-rank)."""
    nnodes = args.nnodes or "1"
    low, _, high = nnodes.partition(":")
    if not (low.isdigit() and (high or low).isdigit() and 1 <= int(low) <= int(high or low)):
        raise UserError(f"--nnodes {nnodes}: expected a number of machines N or MIN:MAX (e.g. 2 or 1:4)")
    several = int(high or low) > 1
    if not several and not args.rdzv_endpoint:
        argv = ["--standalone"]
    elif not args.rdzv_endpoint:
        raise UserError(
            f"--nnodes {nnodes}: the machines need a meeting point; add --rdzv-endpoint HOST:PORT "
            "(a free port on a host every machine reaches, the same on every machine)"
        )
    elif args.node_rank is not None:
        if high:
            raise UserError(
                f"--node-rank {args.node_rank}: an elastic job (--nnodes {nnodes}) numbers machines as "
                "they join; leave --node-rank out"
            )
        if not 0 <= args.node_rank < int(low):
            raise UserError(f"--node-rank {args.node_rank}: expected 0..{int(low) - 1} (--nnodes {nnodes})")
        host, _, port = args.rdzv_endpoint.rpartition(":")
        argv = ["--nnodes", nnodes, "--node-rank", str(args.node_rank), "--master-addr", host, "--master-port", port]
    else:
        argv = ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", args.rdzv_endpoint]
        argv += ["--rdzv-id", args.rdzv_id] + (["--rdzv-conf", args.rdzv_conf] if args.rdzv_conf else [])
    argv += ["--nproc-per-node", str(args.nproc_per_node or 1), "--max-restarts", str(args.max_restarts)]
    argv += ["-m", "coretrain", "run", args.config]
    for override in args.overrides:
        argv += ["--set", override]
    return argv
