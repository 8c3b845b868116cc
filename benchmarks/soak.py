"""Randomized fault soak: many jobs, each with one fault drawn by seed, every one must complete
with the losses of a run without faults.

    python benchmarks/soak.py [--faults 50] [--ranks 2] [--seed 0] [--replace-failed-ranks]

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
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from recovery import run_case

KINDS = ("raise", "sigkill", "hang", "sigstop")
SOAK: dict[str, Any] = {
    "inprocess-restart": {},
    "local-checkpoint": {},
    "watchdog": {"step_timeout_seconds": 5.0},
}


def fault(rng: random.Random, ranks: int) -> dict[str, Any]:
    kind = rng.choice(KINDS)
    drawn: dict[str, Any] = {"action": kind, "step": rng.randint(2, 15), "ranks": [rng.randrange(ranks)]}
    if kind != "raise":  # a new process of the restarted job would fire it again
        drawn["attempt"] = 0
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replace-failed-ranks", action="store_true")
    args = parser.parse_args()
    rng = random.Random(args.seed)
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
