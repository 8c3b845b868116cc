"""The ranks of a test's job forked from a warm process, as torch's own distributed tests start
theirs: for the jobs that compare what ranks compute, not how a launcher starts them.

A rank's fresh interpreter spends about 4 CPU-seconds importing torch and ``torch._dynamo``
(every torch optimizer imports it) before its first step, and the suite's layout jobs start over
a hundred ranks. Here one fork server per test worker (multiprocessing's ``forkserver``: a
process that imported them and ran nothing else) forks each rank, and this process serves the
store the ranks meet at, as torchrun's agent does. Launching itself — signals, restarts, a
killed rank, the agent's reports — stays tested through ``coretrain run --nproc-per-node`` and
torchrun.
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

FIXTURES = Path(__file__).resolve().parent / "fixtures"
WARM = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "coretrain.cli", "coretrain.session"]
"""What the fork server imports once: what every rank would import before its first step."""
GRACE_SECONDS = 10.0
"""How long the other ranks have to end on their own once one failed (a rank blocked in a
collective with the failed one would wait for gloo's timeout): then they are killed, as
torchrun's agent kills them."""


def _rank(plan: str, rank: int, world: int, port: int, env: dict[str, str], cwd: str, logs: tuple[str, str]) -> None:
    """One rank: its stdout and stderr appended to the job's (``logs``, shared by the ranks as
    a terminal is: lines interleave as they are written), the job's environment, then the plan."""
    for fd, log in zip((1, 2), logs):
        opened = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    faulthandler.enable()  # a timeout's SIGABRT prints the rank's stacks into its log
    # a crash in a thread of torch's own (gloo's workers) has no Python stack: c10 prints each
    # thread's C++ frames first (job_failure quotes the crashing thread's)
    torch._C._set_print_stack_traces_on_fatal_signal(True)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # the fork server ignores it
    os.environ.clear()
    os.environ.update(env)
    ranks = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world, "GROUP_RANK": 0}
    os.environ.update({name: str(value) for name, value in ranks.items()})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.chdir(cwd)
    sys.path[:0] = [str(FIXTURES), *(entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry)]
    from commands_in_one_job import run_all

    sys.exit(run_all(Path(plan)))


def run_ranks(
    plan: Path, ranks: int, cwd: Path, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``fixtures/commands_in_one_job.py PLAN`` on ``ranks`` forked ranks: their stdout and
    stderr as the job's, and the first failed rank's exit code (124: still running after
    ``timeout`` seconds; each rank's stacks are then in stderr)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(WARM)
    store = dist.TCPStore("127.0.0.1", 0, ranks, is_master=True, wait_for_workers=False)
    job_env = {**os.environ, **(env or {})}
    out, err = plan.with_name(f"{plan.name}.stdout"), plan.with_name(f"{plan.name}.stderr")
    for log in (out, err):
        log.write_text("")
    processes = [
        context.Process(
            target=_rank, args=(str(plan), rank, ranks, store.port, job_env, str(cwd), (str(out), str(err)))
        )
        for rank in range(ranks)
    ]
    for process in processes:
        process.start()
    code = _wait(processes, timeout)
    exits = "".join(f"rank {rank} exitcode {process.exitcode}\n" for rank, process in enumerate(processes))
    return subprocess.CompletedProcess(["forked ranks", str(plan)], code, out.read_text(), err.read_text() + exits)


def _wait(processes: Sequence[multiprocessing.process.BaseProcess], timeout: float) -> int:
    """Wait for every rank; the first failure's exit code (0 when all succeeded). Once one
    failed or the timeout passed (each rank then SIGABRTed), the rest get ``GRACE_SECONDS``."""
    deadline, kill_at, code = time.monotonic() + timeout, 0.0, 0
    while any(process.is_alive() for process in processes):
        now = time.monotonic()
        if not code:
            code = next((process.exitcode for process in processes if process.exitcode), 0)
            if not code and now > deadline:
                code = 124
                for process in processes:
                    if process.pid is not None and process.is_alive():
                        os.kill(process.pid, signal.SIGABRT)
            kill_at = now + GRACE_SECONDS
        elif now > kill_at:
            for process in processes:
                process.kill()
        time.sleep(0.05)
    for process in processes:
        process.join()
    return code or next((process.exitcode for process in processes if process.exitcode), 0)
