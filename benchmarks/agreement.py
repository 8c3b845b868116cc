"""What the loop's cross-rank agreement costs per step: blocking every step (before) vs
non-blocking, read one step late (now).

    python benchmarks/agreement.py [--ranks 2 4] [--steps 300]

Starts torchrun with N gloo ranks (one thread each) training coretrain.testing's tiny model
for ``--steps`` steps with log_interval 100, twice per rank count: with the agreement forced
to block on every step (what coretrain did before), and as it is. Counts, by wrapping
``torch.distributed.all_reduce``, the blocking and the asynchronous all-reduces the run issues,
and reports the median step time of each (ratio against "before" measured in the same run).

The profiler's view of the same: the ``profiler`` plugin traces plain steps 150-152 (no log,
no checkpoint) on rank 0 with Python stacks; every ``torch.distributed.all_reduce`` call in the
trace is attributed to the coretrain function that made it — ``max_over_ranks`` (blocking) or
``OneStepLate.exchange`` (asynchronous) — and the time the step thread spent in it, and in the
``wait`` on the previous step's all-reduce, is summed. DDP's gradient all-reduces (C++, not
coretrain's) are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def rank_main(steps: int, blocking: bool, out: Path) -> None:
    """One rank: train, count all-reduces, write this rank's figures."""
    import torch
    import torch.distributed as dist

    from coretrain import dist as coretrain_dist
    from coretrain.testing import run_steps

    counts = {"blocking": 0, "async": 0}
    original = dist.all_reduce

    def counting(*args: object, **kwargs: object) -> object:
        counts["async" if kwargs.get("async_op") else "blocking"] += 1
        return original(*args, **kwargs)  # type: ignore[arg-type]

    dist.all_reduce = counting  # type: ignore[assignment]
    if blocking:  # the behaviour before: agree on every step, blocking
        exchange = coretrain_dist.OneStepLate.exchange

        def always_now(self: object, *proposal: int, now: bool = False) -> list[int]:
            return exchange(self, *proposal, now=True)  # type: ignore[arg-type]

        coretrain_dist.OneStepLate.exchange = always_now  # type: ignore[method-assign]
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    started = time.perf_counter()
    settings = {
        "run": {"output_dir": str(out / "run")},  # one directory for every rank, as a cluster's
        "train": {"log_interval": 100, "eval_iters": 0},
        "checkpoint": {"save": False},
    }
    profiled = {"profiler": {"start": PROFILED[0], "end": PROFILED[1], "ranks": [0], "with_stack": True}}
    result = run_steps(out / f"rank{rank}", steps, config=settings, tables=profiled if steps > PROFILED[1] else None)
    seconds = time.perf_counter() - started
    times = [m["iteration_time"] for m in result.metrics]
    (out / f"rank{rank}.json").write_text(json.dumps({**counts, "iteration_time": times, "seconds": seconds}))


PROFILED = (150, 152)


def profiled_agreement(trace: Path) -> dict[str, float]:
    """Per agreement (one a step): coretrain's blocking and asynchronous all-reduce calls, and the µs the
    step thread spent in them and in waiting for the previous step's one."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "python_function"]
    mine = [e for e in events if "coretrain/dist.py" in e["name"]]

    def caller(call: dict[str, float]) -> str:
        around = [e for e in mine if e["ts"] <= call["ts"] and e["ts"] + e["dur"] >= call["ts"] + call["dur"]]
        return min(around, key=lambda e: e["dur"])["name"].rsplit(": ", 1)[-1] if around else "other"

    steps = max(sum(e["name"].endswith(": exchange") for e in mine), 1)  # the loop agrees once a step
    figures = {"blocking": 0.0, "async": 0.0, "blocking_us": 0.0, "async_us": 0.0, "wait_us": 0.0}
    for call in events:
        if "distributed_c10d.py" in call["name"] and call["name"].endswith(": all_reduce"):
            kind = {"max_over_ranks": "blocking", "exchange": "async"}.get(caller(call))
            if kind:
                figures[kind] += 1 / steps
                figures[f"{kind}_us"] += call["dur"] / steps
        elif "built-in method wait" in call["name"] and caller(call) == "exchange":
            figures["wait_us"] += call["dur"] / steps
    return figures


def launch(ranks: int, steps: int, blocking: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        command += [__file__, "--rank-main", "--steps", str(steps), "--out", tmp] + (["--blocking"] if blocking else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CORETRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"}
        subprocess.run(command, check=True, capture_output=True, env=env)
        figures = json.loads((Path(tmp) / "rank0.json").read_text())
        traces = list((Path(tmp) / "run" / "profile").glob("rank0_*.json"))
        profiled = profiled_agreement(traces[0]) if traces else {}
    step = sorted(figures["iteration_time"])[len(figures["iteration_time"]) // 2]
    counted = {"blocking": figures["blocking"] / steps, "async": figures["async"] / steps, "step_us": step * 1e6}
    return {**counted, **{f"profiled_{k}": v for k, v in profiled.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--blocking", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_main:
        rank_main(args.steps, args.blocking, args.out)
        return
    print(f"agreement cost, tiny model, {args.steps} steps, log_interval 100, gloo on CPU, 1 thread per rank")
    results = {}
    print(f"{'ranks':>5}  {'agreement':<22} {'blocking/step':>13} {'async/step':>10} {'step µs':>9} {'ratio':>6}")
    for ranks in args.ranks:
        before = launch(ranks, args.steps, blocking=True)
        after = launch(ranks, args.steps, blocking=False)
        results[ranks] = (before, after)
        for name, figures in (("blocking, every step", before), ("one step late (now)", after)):
            ratio = figures["step_us"] / before["step_us"]
            print(
                f"{ranks:>5}  {name:<22} {figures['blocking']:>13.3f} {figures['async']:>10.3f} "
                f"{figures['step_us']:>9.1f} {ratio:>6.3f}"
            )
    if args.steps <= PROFILED[1]:
        return
    window = f"plain steps {PROFILED[0]}-{PROFILED[1]}"
    print(f"\nprofiler, rank 0, {window} (Python stacks on: times inflated), per agreement")
    header = ("blocking", "µs in it", "async", "µs to start", "µs in wait")
    print(f"{'ranks':>5}  {'agreement':<22} " + " ".join(f"{h:>{max(len(h), 8)}}" for h in header))
    for ranks, (before, after) in results.items():
        for name, f in (("blocking, every step", before), ("one step late (now)", after)):
            print(
                f"{ranks:>5}  {name:<22} {f['profiled_blocking']:>8.2f} {f['profiled_blocking_us']:>8.1f} "
                f"{f['profiled_async']:>8.2f} {f['profiled_async_us']:>11.1f} {f['profiled_wait_us']:>10.1f}"
            )


if __name__ == "__main__":
    main()
