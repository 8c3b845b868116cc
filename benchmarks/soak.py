"""Randomized fault soak: many jobs, each with one fault drawn by seed, every one must complete
with the losses of a run without faults.

    python benchmarks/soak.py [--faults 50] [--ranks 2] [--seed 0] [--replace-failed-ranks | --replica-groups]

Each job is ``benchmarks/recovery.py``'s (the tiny workload on gloo ranks, 16 steps, a durable
checkpoint every 4) with ``[plugins.inprocess-restart]``, ``[plugins.local-checkpoint]`` (every
step), the watchdog at a 5 s step timeout and ``--max-restarts 2``; its fault, drawn from
``random.Random(seed)``: a kind — ``raise`` (restarted in-process), ``sigkill`` (the launcher
restarts the job), ``hang`` (the watchdog ends the rank, the launcher restarts the job), ``sigstop``
(the peer names the frozen rank from its heartbeat and ends, the launcher restarts the job) — a
step in 2..15 and a rank. A fault that kills a process fires in the job's first attempt only
(``attempt = 0``). With ``--replace-failed-ranks`` the jobs run under coretrain's own launcher:
a killed rank is replaced alone while the others wait in-process; a rank the watchdog ends (a
hang, or a peer that froze) restarts the job. Prints one line per job and a summary table: jobs
per kind, completed, equal to the reference, and the median seconds over the reference's. Exits 1
if any job failed or trained other losses.

With ``--replica-groups`` every rank is a torchft replica group of its own (recovery.py's (f):
1,000 steps, ``--max-restarts 2``, the watchdog at 60 s), and a fault — ``raise``, ``sigkill``,
``hang`` or ``sigstop``, in the first attempt only, any group but group 0 — ends that group alone
(a frozen one is left behind: the launcher ends it once the others completed without it). A job
passes when it completes and group 0 logged every step once without resuming, counted as many
steps without the faulted group's share (``replica_group_steps_missed``; none when the group was
back before the quorum dropped it) as its log said, and every group of its last quorum ended with
the same weights.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from recovery import REPLICA_STEPS, run_case

from coretrain import read_weights

KINDS = ("raise", "sigkill", "hang", "sigstop")
SOAK: dict[str, Any] = {
    "inprocess-restart": {},
    "local-checkpoint": {},
    "watchdog": {"step_timeout_seconds": 5.0},
}


def fault(rng: random.Random, ranks: int, groups: bool = False) -> dict[str, Any]:
    kind = rng.choice(KINDS)
    rank = rng.randrange(1, ranks) if groups else rng.randrange(ranks)  # group 0 is the one measured
    drawn: dict[str, Any] = {"action": kind, "step": rng.randint(2, 15), "ranks": [rank]}
    if kind != "raise" or groups:  # a new process of the restarted job (or group) would fire it again
        drawn["attempt"] = 0
    return drawn


def group_rows(out: Path) -> list[dict[str, Any]]:
    """Group 0's metrics rows (none when it wrote no metrics file)."""
    metrics = out / "replica_group_0" / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []


def groups_agree(out: Path, rows: list[dict[str, Any]]) -> str | None:
    """What is wrong with a replica-group job's output, or None: group 0 logged every step once
    and never resumed, counted the steps it trained without a group, and all groups end equal."""
    steps = [row["step"] for row in rows if "loss" in row]
    if steps != list(range(1, REPLICA_STEPS + 1)):
        return f"group 0 logged steps {steps[:3]}...{steps[-3:]} ({len(steps)})"
    said = (out / "replica_group_0" / "run.log").read_text()
    if "resumed from" in said:
        return "group 0 resumed from a checkpoint"
    told = sum(int(k) for k in re.findall(r"its share of (\d+) step\(s\)", said))  # when a group came back
    left = {int(g): int(s) for g, s in re.findall(r"replica group (\d+) left the quorum at step (\d+)", said)}
    members = json.loads((out / "replica_group_0" / "torchft-completed.json").read_text())["members"]
    told += sum(REPLICA_STEPS + 1 - step for group, step in left.items() if group not in members)  # away at the end
    counted = rows[-1].get("replica_group_steps_missed", 0.0)
    if counted != told:
        return f"group 0 counted {counted:g} steps without a group's share, its log said {told}"
    last = f"step_{REPLICA_STEPS:08d}"
    first, *others = (read_weights(out / f"replica_group_{g}" / "checkpoints" / last) for g in members)
    if any(not all(torch.equal(weights[k], first[k]) for k in first) for weights in others):
        return "the groups ended with different weights"
    return None


def soak_groups(args: argparse.Namespace, rng: random.Random) -> None:
    """``--replica-groups``: each job's fault ends one group; the others carry on (see the module)."""
    # the watchdog's grace for a rank waiting on others (a quarter of its timeout) must outlast the
    # lighthouse dropping a hung group (its 5 s heartbeat timeout): at 5 s the survivors ended too
    groups = {"torchft": {"replica_groups": args.ranks}, "watchdog": {"step_timeout_seconds": 60.0}}
    done: dict[str, list[tuple[bool, float]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.faults):
            drawn = fault(rng, args.ranks, groups=True)
            root = Path(scratch) / f"job-{i}"
            root.mkdir()
            result = run_case(root, args.ranks, {**groups, "fault-injection": drawn}, ["--max-restarts", "2"])
            rows = group_rows(root / "out")
            wrong = "the job failed" if result is None else groups_agree(root / "out", rows)
            missed = rows[-1].get("replica_group_steps_missed", 0.0) if rows else float("nan")
            done[drawn["action"]].append((wrong is None, missed))
            what = f"{drawn['action']} at step {drawn['step']} on group {drawn['ranks'][0]}"
            print(f"job {i}: {what}: {wrong or 'ok'}", flush=True)
    lines = ["| fault | jobs | passed | steps without a group's share (median) |", "| --- | --- | --- | --- |"]
    for kind, jobs in done.items():
        counts = [m for ok, m in jobs if ok]
        median = f"{statistics.median(counts):g}" if counts else "—"
        lines.append(f"| {kind} | {len(jobs)} | {sum(ok for ok, _ in jobs)} | {median} |")
    print("\n".join(lines))
    sys.exit(0 if all(ok for jobs in done.values() for ok, _ in jobs) else 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replace-failed-ranks", action="store_true")
    parser.add_argument("--replica-groups", action="store_true", help="every rank a torchft replica group")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    if args.replica_groups:
        soak_groups(args, rng)
    launch = ["--max-restarts", "2", *(["--replace-failed-ranks"] if args.replace_failed_ranks else [])]
    done: dict[str, list[tuple[bool, bool, float]]] = {kind: [] for kind in KINDS}
    with tempfile.TemporaryDirectory() as scratch:
        reference = run_case(Path(scratch) / "reference", args.ranks, {}, [])
        if reference is None:
            raise SystemExit("the reference job failed")
        base, _, losses, _ = reference  # seconds, fault to done, losses, resumed step
        for i in range(args.faults):
            drawn = fault(rng, args.ranks)
            root = Path(scratch) / f"job-{i}"
            root.mkdir()
            result = run_case(root, args.ranks, {**SOAK, "fault-injection": drawn}, launch)
            equal = result is not None and result[2] == losses
            seconds = result[0] - base if result is not None else float("nan")
            done[drawn["action"]].append((result is not None, equal, seconds))
            what = f"{drawn['action']} at step {drawn['step']} on rank {drawn['ranks'][0]}"
            verdict = "ok" if equal else "FAILED" if result is None else "OTHER LOSSES"
            print(f"job {i}: {what}: {verdict}, {seconds:+.1f} s", flush=True)
    lines = ["| fault | jobs | completed | losses equal | median cost |", "| --- | --- | --- | --- | --- |"]
    for kind, jobs in done.items():
        costs = [s for ok, _, s in jobs if ok]
        median = f"{statistics.median(costs):+.1f} s" if costs else "—"
        completed, equal = sum(ok for ok, _, _ in jobs), sum(eq for _, eq, _ in jobs)
        lines.append(f"| {kind} | {len(jobs)} | {completed} | {equal} | {median} |")
    print("\n".join(lines))
    sys.exit(0 if all(eq for jobs in done.values() for _, eq, _ in jobs) else 1)


if __name__ == "__main__":
    main()
