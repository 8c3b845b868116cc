"""What a fault costs: seconds and steps of work, for a full job restart and in-process ones.

    python benchmarks/recovery.py [--ranks 2 4] [--repeat 2] [--only-machines]

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
- (e) a machine leaving, with two launchers of half the ranks each (``--nnodes 1:2
  --rdzv-endpoint``, as two machines start them): at step 11 (rank 0 pauses there 0.5 s, every
  run alike) the second launcher and its ranks are SIGKILLed at once, as a machine that goes
  down; under torchrun's agents the first starts its ranks again on the smaller size; under
  coretrain's launchers (``--replace-failed-ranks``) the first's ranks go on in-process once its
  leader misses the heartbeat (3 s, counted: rank 0 pauses only 0.5 s). Each against a
  baseline of the same launchers, nothing killed, on (d)'s batch. ``last_call_timeout`` is 1 s
  for torchrun's agents (their round after a machine left waits that long for more) and 30 s for
  coretrain's (only the first round waits, and starts once both machines came: the second is in
  the job from the start; a job it is not in when it goes down counts as failed);

- (f) a replica group SIGKILLed, with ``[plugins.torchft]`` (``replica_groups`` = the ranks, one
  rank each; ``--max-restarts 1`` restarts the dead group alone): the other groups drop it after
  the lighthouse's heartbeat timeout (5 s, torchft's default) and go on, never restarting; the
  restarted group takes a live group's state and rejoins; and the same with ``mode = "diloco"``
  (``sync_every = 10``), where the groups meet, and the dead group is dropped and comes back,
  only at a sync. Its jobs train ``REPLICA_STEPS`` steps,
  long enough for the group to come back before the end; "cost of the fault" is what the job's
  wall time grew by, "step 10 to 11" group 0's, and "back after" the seconds from the kill to the
  restarted group's joining (its own log). Losses are group 0's, checked against its baseline's
  up to the fault (the shares read after it differ by design);

each also with ``[plugins.local-checkpoint]`` (a checkpoint in host memory after every step),
which the restart resumes from instead of the durable one at step 8; in (e) each launcher has a
``local_dir`` of its own, as two machines' ``/dev/shm`` are, so every local save is copied to
the other machine (its cost is in the case's time).

A case's cost is its wall time less the baseline's (median of ``--repeat``), the time from the
fault to the run being where it was plus the re-done steps; "step 10 to 11" is measured on the
job's own clock instead: the seconds from step 10's row appearing in metrics.jsonl (the fault
comes as step 11 begins) to step 11's (:class:`StepTimes`) — the fault's whole cost, re-done
steps included, plus one step (the baseline's figure) — free of the second of noise between
whole jobs on a loaded machine; the steps lost are the fault's step
less the step the restart resumed from (read from the job's log: 3 from the checkpoint at 8 —
steps 9 to 11 are trained again — 1 from a local one at 10; on several ranks a local checkpoint
is of the step after its request, which is agreed one step late, and the step after a durable
save has none: a fault two steps after that save — at 10 here — resumes from it, 2 steps lost).
Every case checks that its losses are the baseline's; a job that fails is counted and named, not
timed. Prints a markdown table (README's).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
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


PAUSE = {"action": "sleep", "step": FAULT_STEP, "ranks": [0], "sleep_seconds": 0.5, "attempt": 0}
"""(e): rank 0 waits at the fault's step, so the second machine goes down there, not a step or two
later; shorter than the heartbeat's 3 s, so missing the heartbeat is counted in the cost."""


def machine_leaving() -> dict[str, tuple[dict[str, Any], list[str]]]:
    """(e): two launchers; the second killed at the fault's step (or not, for the baselines)."""
    torchrun, own = ["--max-restarts", "1"], ["--replace-failed-ranks"]
    paused: dict[str, Any] = {"fault-injection": PAUSE}
    in_process: dict[str, Any] = {**paused, "inprocess-restart": {}}
    restarted, went_on = (
        "(e) a machine goes down, torchrun's agents restart the ranks",
        "(e) a machine goes down, in-process",
    )
    return {
        "(e) baseline, torchrun's agents": (paused, torchrun),
        restarted: (paused, torchrun),
        f"{restarted}, local checkpoints": ({**paused, **LOCAL}, torchrun),
        "(e) baseline, coretrain's launchers": (in_process, own),
        went_on: (in_process, own),
        f"{went_on}, local checkpoints": ({**in_process, **LOCAL}, own),
    }


REPLICA_STEPS = 1000
"""(f)'s steps: at a few milliseconds each, the survivors still train when the dead group is back."""


def replica_groups(ranks: int) -> dict[str, tuple[dict[str, Any], list[str]]]:
    """(f): every rank a replica group of its own under torchft; rank 1 (group 1) SIGKILLed; per
    step (gradients averaged every step) and with DiLoCo (the groups meet every 10 steps)."""
    groups = {"torchft": {"replica_groups": ranks}}
    diloco = {"torchft": {"replica_groups": ranks, "mode": "diloco", "sync_every": 10}}
    return {
        "(f) baseline, replica groups": (groups, RESTART),
        "(f) a replica group SIGKILLed, the others go on": ({**groups, "fault-injection": KILL}, RESTART),
        "(f) baseline, DiLoCo groups": (diloco, RESTART),
        "(f) a DiLoCo group SIGKILLed, the others go on": ({**diloco, "fault-injection": KILL}, RESTART),
    }


def joined_after_kill(log: Path) -> float:
    """Seconds from group 1's kill to its joining again, from its own run.log's two lines."""
    stamps = {}
    for line in log.read_text(errors="replace").splitlines():
        for key, marker in (("kill", "fault-injection: sigkill"), ("back", "joined at step")):
            if marker in line and key not in stamps:
                stamps[key] = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return stamps["back"] - stamps["kill"] if len(stamps) == 2 else math.nan


def descendants(pid: int) -> list[int]:
    """``pid`` and every process under it (a launcher and its ranks)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        found.append(queue.pop())
        queue += parents.get(found[-1], [])
    return found


def two_machines(
    root: Path, config: Path, ranks: int, launch: list[str], down: bool, own_dirs: bool, clock: StepTimes
) -> subprocess.CompletedProcess[str]:
    """(e): two launchers of ``ranks // 2`` ranks each; with ``down`` the second, ranks and all, is
    SIGKILLed once step 10 is logged (rank 0 pauses at 11); ``own_dirs``: each its own local_dir.
    The first's result."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "coretrain", "run", str(config), "--nnodes", "1:2", "--nproc-per-node"]
    # coretrain's launchers: both machines in the first round (it starts once both came; the
    # setting plays no part in going on without one); torchrun's: 1 s, as its next round after
    # a machine left waits that long for more
    last_call = 30 if "--replace-failed-ranks" in launch else 1
    command += [str(ranks // 2), "--rdzv-endpoint", f"127.0.0.1:{port}"]
    command += ["--rdzv-conf", f"last_call_timeout={last_call}", *launch]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(root / "first.log", "w") as said:  # a file, not a pipe nobody reads while it runs
        own = ["--set", f"plugins.local-checkpoint.local_dir={root / 'first-shm'}"] if own_dirs else []
        first = subprocess.Popen([*command, *own], cwd=root, env=env, stdout=said, stderr=subprocess.STDOUT)
    while first.poll() is None:  # the first hosts the meeting point (the endpoint's machine, which stays)
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    if own_dirs:  # each machine's local_dir its own, as /dev/shm is: the local checkpoints are copied across
        command += ["--set", f"plugins.local-checkpoint.local_dir={root / 'second-shm'}"]
    second = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while down and first.poll() is None:
        if FAULT_STEP - 1 in clock.seen:
            for pid in descendants(second.pid):
                os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    first.wait(timeout=600)
    second.wait(timeout=60)
    return subprocess.CompletedProcess(command, first.returncode, "", (root / "first.log").read_text())


class StepTimes:
    """When each step's row first appears in the job's metrics.jsonl, watched every 10 ms from
    beside the job (the metrics-file plugin flushes every row): the seconds from the fault to its
    step done again, measured on the job's own clock instead of as a difference of whole jobs."""

    def __init__(self, metrics: Path) -> None:
        self.metrics, self.seen = metrics, dict[int, float]()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            self.look()

    def look(self) -> None:
        """Read the whole file (a few rows) each time: a resume rewrites it, in place or not, so an
        offset kept from the last look may point into the middle of a row."""
        try:
            text = self.metrics.read_bytes()
        except FileNotFoundError:
            return
        now = time.monotonic()
        for line in text[: text.rfind(b"\n") + 1].splitlines():  # a row being written waits
            try:
                self.seen.setdefault(int(json.loads(line)["step"]), now)
            except ValueError:  # caught as it was being rewritten
                continue

    def fault_to_done(self) -> float | None:
        """Seconds from the step before the fault's being logged to the fault's step being logged."""
        self._stop.set()
        self._thread.join()
        self.look()
        before, done = self.seen.get(FAULT_STEP - 1), self.seen.get(FAULT_STEP)
        return None if before is None or done is None else done - before


def run_case(
    root: Path,
    ranks: int,
    plugins: dict[str, Any],
    launch: list[str],
    batch: dict[str, int] | None = None,
    machines: bool | None = None,
) -> tuple[float, float, list[float], int | None, float] | None:
    """Wall seconds of one job, the seconds from the fault to its step done again (:class:`StepTimes`),
    the losses it logged and the step it resumed from after the fault;
    None when the job failed (its output's tail printed). ``machines``: two launchers, the second
    going down (True) or not."""
    groups = "torchft" in plugins  # (f): each group writes out/replica_group_G; group 0's is measured
    sections = tiny_config(
        root / "out",
        train={"train_iters": REPLICA_STEPS if groups else STEPS, "log_interval": 1, "eval_iters": 0, **(batch or {})},
        checkpoint={"save_interval": SAVE_EVERY},
        distributed={"backend": "gloo"},
        plugins=plugins,
    )
    config = write_config(root / "config.toml", sections)
    command = [sys.executable, "-m", "coretrain", "run", str(config), "--nproc-per-node", str(ranks)]
    command += launch  # coretrain's launcher: torchrun's agent, as users start it, or its own
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = root / "out" / "replica_group_0" if groups else root / "out"
    started, clock = time.perf_counter(), StepTimes(out / "metrics.jsonl")
    if machines is not None:
        done = two_machines(root, config, ranks, launch, machines, "local-checkpoint" in plugins, clock)
    else:
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    seconds, fault_to_done = time.perf_counter() - started, clock.fault_to_done()
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if line.startswith(("error:", "[E"))]
        print(f"{root}: the job failed, exit {done.returncode}: {errors[-3:]}", file=sys.stderr)
        return None
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    said = (out / "run.log").read_text() if (out / "run.log").exists() else done.stderr
    resumed = re.findall(r"resumed from \S+ \(step (\d+)", said)
    losses = [row["loss"] for row in rows if "loss" in row]
    if machines and not resumed:  # the second machine came after the first's last step: nothing was measured
        print(f"{root}: the second machine was not in the job when it went down", file=sys.stderr)
        return None
    back = (
        joined_after_kill(root / "out" / "replica_group_1" / "run.log")
        if groups and "fault-injection" in plugins
        else math.nan
    )
    recovery = math.nan if fault_to_done is None else fault_to_done
    return seconds, recovery, losses, int(resumed[-1]) if resumed else None, back


def baseline_of(name: str) -> str:
    """The case a case is compared with: (d) and (e) train a batch of their own, (e) on its launchers."""
    if name.startswith("(e)"):
        return "(e) baseline, " + ("torchrun's agents" if "torchrun" in name else "coretrain's launchers")
    if name.startswith("(f)"):
        return "(f) baseline, DiLoCo groups" if "DiLoCo" in name else "(f) baseline, replica groups"
    return "(d) baseline" if name.startswith("(d)") else "baseline"


Measured = tuple[
    dict[str, list[float]], dict[str, list[float]], dict[str, int | None], dict[str, int], dict[str, list[float]]
]


def measure(ranks: int, cases: dict[str, tuple[dict[str, Any], list[str]]], repeat: int) -> Measured:
    """Each case's job seconds, seconds from the fault to its step done again, the step it resumed
    from and how many of its jobs failed; every job's losses checked against its baseline's."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    recoveries: dict[str, list[float]] = {name: [] for name in cases}
    resumed_at: dict[str, int | None] = dict.fromkeys(cases)
    failed = dict.fromkeys(cases, 0)
    backs: dict[str, list[float]] = {name: [] for name in cases}
    references: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for attempt in range(repeat):
            for index, (name, (plugins, launch)) in enumerate(cases.items()):  # interleaved: load hits all alike
                root = Path(scratch) / f"{ranks}-{attempt}-{index}"
                root.mkdir(parents=True)
                machines = ("baseline" not in name) if name.startswith("(e)") else None
                batch = SHRINKABLE if name.startswith(("(d)", "(e)")) else None
                result = run_case(root, ranks, plugins, launch, batch, machines)
                if result is None:
                    failed[name] += 1
                    continue
                seconds, recovery, losses, resumed_at[name], back = result
                reference = references.setdefault(baseline_of(name), losses)
                if name.startswith("(f)"):  # after the fault group 0 trains alone: other updates, by design
                    losses, reference = losses[: FAULT_STEP - 1], reference[: FAULT_STEP - 1]
                # (d), (e) sum the gradients in another order (more accumulation on fewer ranks)
                close = len(losses) == len(reference) and all(
                    math.isclose(a, b, rel_tol=1e-5) for a, b in zip(losses, reference)
                )
                if losses != reference and not (name.startswith(("(d)", "(e)")) and close):
                    raise SystemExit(f"{name} on {ranks} ranks: losses differ from the baseline's")
                times[name].append(seconds)
                recoveries[name].append(recovery)
                backs[name].append(back)
    return times, recoveries, resumed_at, failed, backs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--only-machines", action="store_true", help="only (e), a machine going down")
    parser.add_argument("--only-replica-groups", action="store_true", help="only (f), torchft's replica groups")
    args = parser.parse_args()
    lines = [f"| ranks | case | job seconds | cost of the fault | step {FAULT_STEP - 1} to {FAULT_STEP} | steps lost |"]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for ranks in args.ranks:
        cases = {**CASES, **leaving(ranks), **machine_leaving(), **replica_groups(ranks)}
        cases = (
            machine_leaving() if args.only_machines else replica_groups(ranks) if args.only_replica_groups else cases
        )
        times, recoveries, resumed_at, failed, backs = measure(ranks, cases, args.repeat)
        for name, measured in times.items():
            median, base = statistics.median(measured) if measured else math.nan, baseline_of(name)
            cost = "—" if name == base else f"{median - statistics.median(times[base]):+.1f} s"
            recovery = statistics.median(recoveries[name]) if recoveries[name] else math.nan
            step = resumed_at[name]
            lost = "—" if name == base else "?" if step is None else str(FAULT_STEP - step)
            if name.startswith("(f)") and name != base:  # the survivors lose none; the dead group is back after
                lost = f"0 (group 1 back after {statistics.median(backs[name]):.1f} s)" if step is None else "?"
            note = f" ({failed[name]} of {args.repeat} jobs failed)" if failed[name] else ""
            lines.append(f"| {ranks} | {name}{note} | {median:.1f} | {cost} | {recovery:.2f} s | {lost} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
