"""``coretrain run --nproc-per-node N`` with ``[plugins.torchft]``: torchft's lighthouse beside the
launcher, and one torchrun job per replica group (a launcher of its own) — each restarted alone by its own agent
(``--max-restarts``), while the other groups train on. With ``--nnodes N --node-rank R``, each machine
starts its share of the groups, and machine 0 the lighthouse at ``--rdzv-endpoint``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coretrain import UserError

ENDED_FILE = "torchft-completed.json"
"""Written in a group's output directory when it completed: its step and the groups of its last quorum."""


def launch_groups(
    args: argparse.Namespace,
    loaded: Any,
    check: Callable[[list[int]], None],
    groups: int,
    lighthouse: str | dict[str, Any],
    grace: float,
) -> int:
    """This machine's exit code: 0 when each of its groups completed, or was ended here because it
    was not in the quorum the groups that completed ended with; else the first failing group's.
    ``lighthouse``: the address of one running, or the settings of the one to start here;
    ``grace``: how long such a group may still run once the others completed."""
    nproc = args.nproc_per_node or 1
    mine = _groups_of_this_machine(args, groups)
    if nproc % len(mine):
        raise UserError(
            f"--nproc-per-node {nproc}: must be a multiple of the replica groups on this machine ({len(mine)}); "
            "each group takes as many ranks"
        )
    per_group = nproc // len(mine)
    within = _replica_within_group(loaded.config, groups)
    check([per_group])  # a group's layout and batch sizes fit its ranks
    output = Path(loaded.config.output_dir)
    server, address = _lighthouse(args, lighthouse, output / "lighthouse.log")
    here = f"; groups {mine[0]} to {mine[-1]} on this machine" if len(mine) < groups else ""
    print(
        f"coretrain: torchft: {groups} replica groups of {per_group} rank(s), lighthouse at {address}; "
        f"group G writes {output}/replica_group_G{here}",
        file=sys.stderr,
    )
    processes = {group: _start(args, group, per_group, address, output, within) for group in mine}
    try:
        with _forwarding_signals(list(processes.values())):
            codes = _wait(processes, output, grace)
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
        if server is not None:
            server.terminate()
            server.wait()
    failed = [(group, code) for group, code in codes.items() if code]  # (None: ended here, not failed)
    if not failed:
        return 0
    group, code = failed[0]
    if len(failed) == len(mine) and {c for _, c in failed} == {code} and code > 128:  # a signal all obeyed
        return code  # (each saved a checkpoint and said so)
    print(f"error: replica group {group} ended with exit code {code}", file=sys.stderr)
    return code if code > 0 else 128 - code


def _groups_of_this_machine(args: argparse.Namespace, groups: int) -> list[int]:
    """All the groups, or with ``--nnodes N --node-rank R`` the R-th N-th of them (each group on one machine)."""
    if args.replace_failed_ranks:
        raise UserError("--replace-failed-ranks: not with plugins.torchft; a failed replica group is restarted alone")
    nnodes = args.nnodes or "1"
    if not nnodes.isdigit():
        raise UserError(
            f"--nnodes {nnodes}: replica groups come and go on their own under torchft; give a fixed --nnodes N "
            "and each machine's --node-rank"
        )
    machines = int(nnodes)
    if machines == 1:
        return list(range(groups))
    if args.node_rank is None or groups % machines:
        raise UserError(
            f"--nnodes {machines}: each machine starts replica_groups / {machines} of the {groups} groups: give "
            f"each its --node-rank (0..{machines - 1}), and a replica_groups that {machines} divides"
        )
    share = groups // machines
    return list(range(args.node_rank * share, (args.node_rank + 1) * share))


def _lighthouse(
    args: argparse.Namespace, given: str | dict[str, Any], log_file: Path
) -> tuple[subprocess.Popen[bytes] | None, str]:
    """The lighthouse's process (None when it is not this machine's) and address: the one given;
    on one machine one started here; across machines one at ``--rdzv-endpoint``, where the
    machines meet, started by machine 0 (the others wait for it)."""
    if isinstance(given, str):
        return None, given
    if (args.nnodes or "1") == "1":
        return start_lighthouse(given, log_file, port=0)
    host, _, port = args.rdzv_endpoint.rpartition(":")
    address = f"http://{host}:{port}"
    if args.node_rank == 0:
        return start_lighthouse(given, log_file, port=int(port))[0], address
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=1):
            return None, address
        time.sleep(0.5)
    raise UserError(f"plugins.torchft: machine 0's lighthouse at {address} did not answer within 120 s; is it started?")


def _wait(processes: dict[int, subprocess.Popen[bytes]], output: Path, grace: float) -> dict[int, int | None]:
    """Each group's exit code, None for a group ended here: one still running ``grace`` seconds after
    another completed without it in its last quorum (it left: frozen, as a stopped process, or cut
    off), which nothing else ends — its agent sees a live process, and its own watchdog is frozen too."""
    completed_at: float | None = None
    ended: set[int] = set()
    while any(process.poll() is None for process in processes.values()):
        time.sleep(0.2)
        codes = {group: process.poll() for group, process in processes.items()}
        if completed_at is None and 0 in codes.values():
            completed_at = time.monotonic()
        if completed_at is None or time.monotonic() - completed_at < grace:
            continue
        kept = _last_quorum(output, codes)
        for group, process in processes.items():
            if process.poll() is None and group not in kept:
                print(
                    f"coretrain: torchft: replica group {group} was not in the quorum the others completed with, and "
                    f"had not ended {grace:g} s later (frozen?); ending it",
                    file=sys.stderr,
                )
                _kill_tree(process.pid)
                process.wait()
                ended.add(group)
    return {group: None if group in ended else process.returncode for group, process in processes.items()}


def _last_quorum(output: Path, codes: dict[int, int | None]) -> set[int]:
    """The groups of the last quorum of the groups that completed (what their plugin wrote)."""
    kept: set[int] = set()
    for group, code in codes.items():
        ended = output / f"replica_group_{group}" / ENDED_FILE
        if code == 0 and ended.exists():
            kept.update(json.loads(ended.read_text())["members"])
    return kept


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and its descendants (a stopped process obeys only SIGKILL; the agent's
    workers run in sessions of their own, so a process group would miss them)."""
    family, i = [pid], 0
    while i < len(family):
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{family[i]}/task").iterdir():
                family += [int(child) for child in (task / "children").read_text().split()]
        i += 1
    for member in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def _replica_within_group(config: Any, groups: int) -> list[str]:
    """HSDP's replicate dimension, when the config has one, is the replica groups: each group is one
    replica, sharding over its own ranks. The overrides that make a group's job so (also applied to
    ``config``, which the group's layout is checked with)."""
    distributed = config.distributed
    if distributed.dp_replicate == 1:
        return []
    if distributed.dp_replicate != groups:
        raise UserError(
            f"distributed.dp_replicate = {distributed.dp_replicate} with [plugins.torchft]: the replica groups are "
            f"HSDP's replicate dimension; set plugins.torchft.replica_groups = {distributed.dp_replicate} "
            f"(it is {groups})"
        )
    distributed.dp_replicate = 1
    if distributed.strategy == "auto":  # (auto would choose ddp for a group: FSDP is what HSDP's replicas do)
        distributed.strategy = "fsdp"
    return ["distributed.dp_replicate=1", f'distributed.strategy="{distributed.strategy}"']


def _start(
    args: argparse.Namespace, group: int, ranks: int, lighthouse: str, output: Path, within: list[str]
) -> subprocess.Popen[bytes]:
    """One group's job — ``coretrain run --nproc-per-node`` again, so that its agent's signals and
    failures are said as any job's — its output in a directory of its own (one run per directory)."""
    command = [sys.executable, "-m", "coretrain", "run", args.config, "--nproc-per-node", str(ranks)]
    command += ["--max-restarts", str(args.max_restarts)]
    for override in [*args.overrides, *within, f"run.output_dir={json.dumps(str(output / f'replica_group_{group}'))}"]:
        command += ["--set", override]
    environment = {**os.environ, "REPLICA_GROUP_ID": str(group), "TORCHFT_LIGHTHOUSE": lighthouse}
    return subprocess.Popen(command, env=environment)


def start_lighthouse(settings: dict[str, Any], log_file: Path, port: int) -> tuple[subprocess.Popen[bytes], str]:
    """torchft's lighthouse (its own binary, its log in the job's output directory) on ``port`` (0:
    a free one), and its address once it listens."""
    binary = shutil.which("torchft_lighthouse") or str(Path(sys.executable).parent / "torchft_lighthouse")
    command = [binary, "--bind", f"[::]:{port}", *(f"--{key}={value}" for key, value in settings.items())]
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
