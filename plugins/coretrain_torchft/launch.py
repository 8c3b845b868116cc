"""``coretrain run --nproc-per-node N`` with ``[plugins.torchft]``: torchft's lighthouse beside the
launcher, and one torchrun job per replica group (a launcher of its own) — each restarted alone by its own agent
(``--max-restarts``), while the other groups train on."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coretrain import UserError


def launch_groups(
    args: argparse.Namespace,
    loaded: Any,
    check: Callable[[list[int]], None],
    groups: int,
    lighthouse: str | dict[str, Any],
) -> int:
    """The job's exit code: 0 when every group completed, else the first failing group's.
    ``lighthouse``: the address of one running, or the settings of the one to start here."""
    nproc = args.nproc_per_node or 1
    if (args.nnodes or "1") != "1" or args.rdzv_endpoint or args.replace_failed_ranks:
        raise UserError(
            "plugins.torchft: coretrain starts the replica groups on one machine (--nproc-per-node); across "
            "machines start each group's job yourself with REPLICA_GROUP_ID and TORCHFT_LIGHTHOUSE set"
        )
    if nproc % groups:
        raise UserError(
            f"--nproc-per-node {nproc}: must be a multiple of plugins.torchft.replica_groups ({groups}); each "
            "group takes as many ranks"
        )
    per_group = nproc // groups
    check([per_group])  # a group's layout and batch sizes fit its ranks
    output = Path(loaded.config.output_dir)
    server = None
    if isinstance(lighthouse, str):
        address = lighthouse
    else:
        server, address = _start_lighthouse(lighthouse, output / "lighthouse.log")
    print(
        f"coretrain: torchft: {groups} replica groups of {per_group} rank(s), lighthouse at {address}; "
        f"group G writes {output}/replica_group_G",
        file=sys.stderr,
    )
    processes = [_start(args, group, per_group, address, output) for group in range(groups)]
    try:
        with _forwarding_signals(processes):
            codes = [process.wait() for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
        if server is not None:
            server.terminate()
            server.wait()
    failed = [(group, code) for group, code in enumerate(codes) if code]
    if not failed:
        return 0
    if len(failed) == groups and len(set(codes)) == 1 and codes[0] > 128:  # a signal every group obeyed
        return codes[0]  # (each saved a checkpoint and said so)
    group, code = failed[0]
    print(f"error: replica group {group} ended with exit code {code}", file=sys.stderr)
    return code if code > 0 else 128 - code


def _start(args: argparse.Namespace, group: int, ranks: int, lighthouse: str, output: Path) -> subprocess.Popen[bytes]:
    """One group's job — ``coretrain run --nproc-per-node`` again, so that its agent's signals and
    failures are said as any job's — its output in a directory of its own (one run per directory)."""
    command = [sys.executable, "-m", "coretrain", "run", args.config, "--nproc-per-node", str(ranks)]
    command += ["--max-restarts", str(args.max_restarts)]
    for override in [*args.overrides, f"run.output_dir={json.dumps(str(output / f'replica_group_{group}'))}"]:
        command += ["--set", override]
    environment = {**os.environ, "REPLICA_GROUP_ID": str(group), "TORCHFT_LIGHTHOUSE": lighthouse}
    return subprocess.Popen(command, env=environment)


def _start_lighthouse(settings: dict[str, Any], log_file: Path) -> tuple[subprocess.Popen[bytes], str]:
    """torchft's lighthouse (its own binary, its log in the job's output directory) on a free port,
    and its address once it listens."""
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    command = [binary, "--bind", "[::]:0", *(f"--{key}={value}" for key, value in settings.items())]
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("wb") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.poll() is None:
        said = re.search(r"Lighthouse listening on: (http://\S+)", log_file.read_text(errors="replace"))
        if said:
            return server, said.group(1)
        time.sleep(0.05)
    server.kill()
    raise UserError(f"plugins.torchft: torchft's lighthouse did not start; its log: {log_file}")


@contextlib.contextmanager
def _forwarding_signals(processes: list[subprocess.Popen[bytes]]) -> Any:
    """SIGTERM / SIGINT to the launcher go to every group's agent, which passes them to its ranks."""

    def forward(signum: int, frame: Any) -> None:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
