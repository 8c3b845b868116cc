"""Step-time jitter from Python's garbage collector, with and without the ``gc`` plugin.

    python benchmarks/gc_variance.py [--steps 600]

The workload makes cyclic garbage every step (as autograd graphs, closures and logging
dicts do) on top of a large long-lived heap that keeps growing (as datasets, tokenizers,
caches and histories do). With
automatic GC, full collections fire whenever allocation counts say so and rescan the whole
heap; with the plugin (interval 50, heap frozen after warm-up) collections happen on
known steps and skip the frozen heap. Reported: mean, standard deviation, p99 and max of
the step time, for each setting, in one process.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from coretrain import hookimpl
from coretrain.build import build_run, close_run
from coretrain.config import Config
from coretrain.configload import structure
from coretrain.loop import Trainer
from coretrain.pluginmanager import load_plugins
from coretrain.run import Datasets

LONG_LIVED: list[Any] = []


class GarbageMaker(torch.nn.Module):
    """A small MLP whose forward leaves 3000 reference cycles behind and keeps 2000 objects."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for _ in range(3000):
            a: dict[str, Any] = {}
            a["self"] = a
        LONG_LIVED.extend([i] for i in range(2000))  # a cache that grows, as histories do
        return torch.nn.functional.mse_loss(self.net(x), y)


def make_model() -> torch.nn.Module:
    return GarbageMaker()


def make_data() -> Datasets:
    from coretrain_windows import TokenWindows  # noqa: F401 - keeps the import path realistic

    class Pairs:
        def __init__(self) -> None:
            self.x, self.y = torch.randn(4096, 32), torch.randn(4096, 1)

        def __len__(self) -> int:
            return 4096

        def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.x[indices], self.y[indices]

    return Datasets(train=Pairs())


class StepTimer:
    def __init__(self) -> None:
        self.times: list[float] = []
        self._last = 0.0

    @hookimpl
    def pre_step(self) -> None:
        self._last = time.perf_counter()

    @hookimpl
    def post_step(self) -> None:
        self.times.append(time.perf_counter() - self._last)


def measure(steps: int, plugins: dict[str, Any], output_dir: str) -> list[float]:
    cfg = structure(
        {
            "run": {"output_dir": output_dir},
            "model": {"provider": "gc_variance:make_model"},
            "data": {"provider": "gc_variance:make_data"},
            "train": {"micro_batch_size": 32, "train_iters": steps, "log_interval": 100, "eval_iters": 0},
            "checkpoint": {"save": False, "resume": "never"},
            "plugins": plugins,
        },
        Config,
    )
    run_plugins = load_plugins(cfg)
    timer = StepTimer()
    run_plugins.register("timer", timer)
    trainer = Trainer(build_run(cfg, run_plugins))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    close_run(trainer.run, failing=False)
    return timer.times[50:]  # after warm-up


def describe(times: list[float]) -> str:
    ms = sorted(t * 1e3 for t in times)
    p99 = ms[int(0.99 * (len(ms) - 1))]
    return (
        f"mean {statistics.mean(ms):6.2f} ms   std {statistics.stdev(ms):6.2f} ms   "
        f"p99 {p99:6.2f} ms   max {ms[-1]:6.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    sys.modules.setdefault("gc_variance", sys.modules[__name__])
    os.environ["CORETRAIN_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    torch.set_num_threads(1)
    LONG_LIVED.extend({"i": i, "payload": [i]} for i in range(1_000_000))  # a big long-lived heap
    gc.collect()
    with tempfile.TemporaryDirectory() as tmp:
        automatic = measure(args.steps, {}, f"{tmp}/a")
        del LONG_LIVED[1_000_000:]
        gc.collect()
        manual = measure(args.steps, {"gc": {"interval": 50, "freeze_after_warmup": 50}}, f"{tmp}/b")
    print(
        f"step time over {len(automatic)} steps (3000 reference cycles and 2000 kept objects per step, "
        "on 1M long-lived objects)"
    )
    print(f"  automatic GC        {describe(automatic)}")
    print(f"  gc plugin (50, frozen after warm-up)  {describe(manual)}")
    ratio = statistics.stdev(manual) / statistics.stdev(automatic)
    print(f"  std ratio plugin/automatic {ratio:.3f}")


if __name__ == "__main__":
    main()
