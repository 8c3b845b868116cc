"""What the loop's cross-rank agreement costs per step: blocking every step (before) vs
non-blocking, read one step late (now).

    python benchmarks/agreement.py [--ranks 2 4] [--steps 300]

Starts torchrun with N gloo ranks (one thread each) training coretrain.testing's tiny model
for ``--steps`` steps with log_interval 100, twice per rank count: with the agreement forced
to block on every step (what coretrain did before), and as it is. Counts, by wrapping
``torch.distributed.all_reduce``, the blocking and the asynchronous all-reduces the run issues,
and reports the median step time of each (ratio against "before" measured in the same run).
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
    result = run_steps(out / f"rank{rank}", steps, config=settings)
    seconds = time.perf_counter() - started
    times = [m["iteration_time"] for m in result.metrics]
    (out / f"rank{rank}.json").write_text(json.dumps({**counts, "iteration_time": times, "seconds": seconds}))


def launch(ranks: int, steps: int, blocking: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
        command += [__file__, "--rank-main", "--steps", str(steps), "--out", tmp] + (["--blocking"] if blocking else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CORETRAIN_DISABLE_PLUGIN_AUTOLOAD": "1"}
        subprocess.run(command, check=True, capture_output=True, env=env)
        figures = json.loads((Path(tmp) / "rank0.json").read_text())
    step = sorted(figures["iteration_time"])[len(figures["iteration_time"]) // 2]
    return {"blocking": figures["blocking"] / steps, "async": figures["async"] / steps, "step_us": step * 1e6}


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
    print(f"{'ranks':>5}  {'agreement':<22} {'blocking/step':>13} {'async/step':>10} {'step µs':>9} {'ratio':>6}")
    for ranks in args.ranks:
        before = launch(ranks, args.steps, blocking=True)
        after = launch(ranks, args.steps, blocking=False)
        for name, figures in (("blocking, every step", before), ("one step late (now)", after)):
            ratio = figures["step_us"] / before["step_us"]
            print(
                f"{ranks:>5}  {name:<22} {figures['blocking']:>13.3f} {figures['async']:>10.3f} "
                f"{figures['step_us']:>9.1f} {ratio:>6.3f}"
            )


if __name__ == "__main__":
    main()
