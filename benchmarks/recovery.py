"""What a fault costs: seconds and steps of work, for a full job restart and in-process ones.

    python benchmarks/recovery.py [--ranks 2 4] [--repeat 2]

One job per case (``coretrain run --nproc-per-node N``: torchrun's agent, as users start it), on
the tiny workload (gloo, one torch thread per rank), 16 steps, a checkpoint every 4, and rank 1
raising at step 11 (``fault-injection``):

- baseline — no fault;
- (a) full restart — ``--max-restarts 1``: every worker exits and is started again,
  re-imports torch, rebuilds and resumes from the checkpoint at step 8;
- (b) in-process restart — ``[plugins.inprocess-restart]``: the ranks re-form their process group
  and rebuild and resume in the same processes;
- (c) a dead process (SIGKILL at step 11): under torchrun's agent the same as (a), every worker
  of the job is started again; with ``--replace-failed-ranks`` (coretrain's launcher) a new
  process takes the dead one's place alone while the others wait for it in-process;
- (d) a node leaving: the upper half of the ranks killed at step 11 (as one machine of two would
  go); with ``--replace-failed-ranks --min-ranks N/2`` the lower half goes on in-process as a job
  of half the size, the global batch kept by accumulation — on a batch every size from half up
  fits (micro 4, global 48), against a baseline of its own on it (its losses equal the
  baseline's within 1e-5: the gradients are summed in another order);

each also with ``[plugins.local-checkpoint]`` (a checkpoint in host memory after every step),
which the restart resumes from instead of the durable one at step 8.

A case's cost is its wall time less the baseline's (median of ``--repeat``), the time from the
fault to the run being where it was plus the re-done steps; the steps lost are the fault's step
less the step the restart resumed from (read from the job's log: 3 from the checkpoint at 8 —
steps 9 to 11 are trained again — 1 from a local one at 10; on several ranks a local checkpoint
is of the step after its request, which is agreed one step late, and the step after a durable
save has none: a fault two steps after that save — at 10 here — resumes from it, 2 steps lost).
Every case checks that its losses are the baseline's; a job that fails is counted and named, not
timed. Prints a markdown table (README's).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from coretrain.testing import tiny_config, write_config

FAULT_STEP, SAVE_EVERY, STEPS = 11, 4, 16
LOCAL: dict[str, Any] = {"local-checkpoint": {}}  # a checkpoint in host memory (/dev/shm) after every step
RAISE = {"action": "raise", "step": FAULT_STEP, "ranks": [1]}
KILL = {"action": "sigkill", "step": FAULT_STEP, "ranks": [1], "attempt": 0}
RESTART, REPLACE = ["--max-restarts", "1"], ["--max-restarts", "1", "--replace-failed-ranks"]
REPLACED: dict[str, Any] = {"fault-injection": KILL, "inprocess-restart": {}}
CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "baseline": ({}, []),
    "(a) full restart": ({"fault-injection": {**RAISE, "attempt": 0}}, RESTART),
    "(a) full restart, local checkpoints": ({"fault-injection": {**RAISE, "attempt": 0}, **LOCAL}, RESTART),
    "(b) in-process restart": ({"fault-injection": RAISE, "inprocess-restart": {}}, []),
    "(b) in-process restart, local checkpoints": ({"fault-injection": RAISE, "inprocess-restart": {}, **LOCAL}, []),
    "(c) dead process (SIGKILL), job restarted": ({"fault-injection": KILL}, RESTART),
    "(c) dead process (SIGKILL), job restarted, local checkpoints": ({"fault-injection": KILL, **LOCAL}, RESTART),
    "(c) dead process (SIGKILL), replaced alone": (REPLACED, REPLACE),
    "(c) dead process (SIGKILL), replaced alone, local checkpoints": ({**REPLACED, **LOCAL}, REPLACE),
}


SHRINKABLE = {"micro_batch_size": 4, "global_batch_size": 48}
"""(d)'s batch: a global batch every size from half the ranks up fits (4 × 2, × 3, × 4 divide 48)."""


def leaving(ranks: int) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """(d): the upper half of the ranks — a machine's, were each half one — killed at the fault's
    step; ``--min-ranks`` lets the lower half go on in-process as a job of half the size. On a
    batch of its own, which its baseline trains too."""
    gone = {"action": "sigkill", "step": FAULT_STEP, "ranks": list(range(ranks // 2, ranks)), "attempt": 0}
    plugins: dict[str, Any] = {"fault-injection": gone, "inprocess-restart": {}}
    launch = ["--replace-failed-ranks", "--min-ranks", str(ranks // 2)]
    return {
        "(d) baseline": ({}, []),
        "(d) half the ranks leave, the rest go on": (plugins, launch),
        "(d) half the ranks leave, the rest go on, local checkpoints": ({**plugins, **LOCAL}, launch),
    }


def run_case(
    root: Path, ranks: int, plugins: dict[str, Any], launch: list[str], batch: dict[str, int] | None = None
) -> tuple[float, list[float], int | None] | None:
    """Wall seconds of one torchrun job, the losses it logged and the step it resumed from after
    the fault; None when the job failed (its output's tail printed)."""
    sections = tiny_config(
        root / "out",
        train={"train_iters": STEPS, "log_interval": 1, "eval_iters": 0, **(batch or {})},
        checkpoint={"save_interval": SAVE_EVERY},
        distributed={"backend": "gloo"},
        plugins=plugins,
    )
    config = write_config(root / "config.toml", sections)
    command = [sys.executable, "-m", "coretrain", "run", str(config), "--nproc-per-node", str(ranks)]
    command += launch  # coretrain's launcher: torchrun's agent, as users start it, or its own
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.perf_counter()
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith(("error:", "[E"))]
        print(f"{root}: the job failed, exit {done.returncode}: {errors[-3:]}", file=sys.stderr)
        return None
    rows = [json.loads(line) for line in (root / "out" / "metrics.jsonl").read_text().splitlines()]
    said = (root / "out" / "run.log").read_text() if (root / "out" / "run.log").exists() else done.stderr
    resumed = re.findall(r"resumed from \S+ \(step (\d+)", said)
    return seconds, [row["loss"] for row in rows if "loss" in row], int(resumed[-1]) if resumed else None


def baseline_of(name: str) -> str:
    """The case a case is compared with: (d) trains a batch of its own."""
    return "(d) baseline" if name.startswith("(d)") else "baseline"


Measured = tuple[dict[str, list[float]], dict[str, int | None], dict[str, int]]


def measure(ranks: int, cases: dict[str, tuple[dict[str, Any], list[str]]], repeat: int) -> Measured:
    """Each case's job seconds, the step it resumed from and how many of its jobs failed; every
    job's losses checked against its baseline's."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    resumed_at: dict[str, int | None] = dict.fromkeys(cases)
    failed = dict.fromkeys(cases, 0)
    references: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for attempt in range(repeat):
            for index, (name, (plugins, launch)) in enumerate(cases.items()):  # interleaved: load hits all alike
                root = Path(scratch) / f"{ranks}-{attempt}-{index}"
                root.mkdir(parents=True)
                result = run_case(root, ranks, plugins, launch, SHRINKABLE if name.startswith("(d)") else None)
                if result is None:
                    failed[name] += 1
                    continue
                seconds, losses, resumed_at[name] = result
                reference = references.setdefault(baseline_of(name), losses)
                # (d) sums the gradients in another order (more accumulation on fewer ranks)
                close = len(losses) == len(reference) and all(
                    math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, reference)
                )
                if losses != reference and not (name.startswith("(d)") and close):
                    raise SystemExit(f"{name} on {ranks} ranks: losses differ from the baseline's")
                times[name].append(seconds)
    return times, resumed_at, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    lines = ["| ranks | case | job seconds | cost of the fault | steps lost |", "| --- | --- | --- | --- | --- |"]
    for ranks in args.ranks:
        times, resumed_at, failed = measure(ranks, {**CASES, **leaving(ranks)}, args.repeat)
        for name, measured in times.items():
            median = statistics.median(measured) if measured else float("nan")
            base = baseline_of(name)
            cost = "—" if name == base else f"{median - statistics.median(times[base]):+.1f} s"
            step = resumed_at[name]
            lost = "—" if name == base else "?" if step is None else str(FAULT_STEP - step)
            note = f" ({failed[name]} of {args.repeat} jobs failed)" if failed[name] else ""
            lines.append(f"| {ranks} | {name}{note} | {median:.1f} | {cost} | {lost} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
