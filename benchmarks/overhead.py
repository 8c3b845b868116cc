"""Per-step framework overhead of coretrain against a hand-written loop, plus startup times.

    python benchmarks/overhead.py [--rounds 15] [--steps 1000]

Same model (64-wide MLP), data (in-memory tensors, batch 32), optimizer (AdamW, no weight
decay on biases, clip 1.0), one CPU thread. Rounds alternate hand-written and coretrain (every
on-by-default plugin on, as a user runs it: progress, metrics-file, timers, watchdog, ...;
log_interval 100) in one process, so drift hits both alike. Each coretrain
round builds a fresh run outside the timing and times ``Trainer.train()`` end to end.
Reported: median µs/step of each, the median per-round difference and the ratio. Target: ≤ 10 µs/step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from coretrain.build import build_run, close_run
from coretrain.config import Config
from coretrain.configload import structure
from coretrain.loop import Trainer
from coretrain.pluginmanager import load_plugins
from coretrain.run import Datasets

WIDTH, BATCH, SAMPLES, LOG_INTERVAL = 64, 32, 32 * 512, 100


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x), y)


class Tensors:
    """In-memory regression data with the batched fast path both loops use."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, WIDTH, generator=g)
        self.y = self.x[:, :1] + 0.1 * torch.randn(SAMPLES, 1, generator=g)  # noise: the loss never reaches 0

    def __len__(self) -> int:
        return SAMPLES

    def get_batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[indices], self.y[indices]


def make_model() -> torch.nn.Module:
    return MLP()


def make_data() -> Datasets:
    return Datasets(train=Tensors())


def hand_written(steps: int) -> float:
    """The loop a person writes: shuffled batches, forward, backward, clip, step, zero, log."""
    torch.manual_seed(0)
    model, data = MLP(), Tensors()
    params = list(model.parameters())
    groups = [  # nanoGPT's and Megatron's groups, as coretrain's default optimizer-overrides makes them
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},  # biases and norms
    ]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    start = time.perf_counter()
    for step in range(1, steps + 1):
        epoch, first = divmod((step - 1) * BATCH, SAMPLES)
        if first == 0:  # reshuffle every epoch, seeded like coretrain's sampler
            perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
        x, y = data.get_batch(perm[first : first + BATCH])
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % LOG_INTERVAL == 0:
            print(f"step {step} loss {loss.item():.4f}")
    return (time.perf_counter() - start) / steps


def config(output_dir: str, steps: int) -> Config:
    return structure(
        {
            "run": {"output_dir": output_dir, "seed": 0},
            "model": {"provider": f"{__name__}:make_model"},
            "data": {"provider": f"{__name__}:make_data"},
            "train": {
                "micro_batch_size": BATCH,
                "train_iters": steps,
                "log_interval": LOG_INTERVAL,
                "eval_iters": 0,
                "clip_grad": 1.0,
            },
            "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
            "plugins": {"schedule": {"decay_style": "constant"}},
            "checkpoint": {"save": False, "resume": "never"},
        },
        Config,
    )


def with_coretrain(steps: int, output_dir: str) -> float:
    cfg = config(output_dir, steps)
    run = build_run(cfg, load_plugins(cfg))
    trainer = Trainer(run)
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start
    close_run(run, failing=False)
    return elapsed / steps


def wall(command: list[str], repeat: int = 5, env: dict[str, str] | None = None) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, env={**os.environ, **(env or {})})
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def startup(tmp: str) -> None:
    here = Path(__file__).resolve().parent
    config_path = Path(tmp) / "one_step.toml"
    config_path.write_text(
        f'[run]\noutput_dir = "{tmp}/startup"\nthreads = 1\n[model]\nprovider = "overhead:make_model"\n'
        f'[data]\nprovider = "overhead:make_data"\n[train]\nmicro_batch_size = {BATCH}\ntrain_iters = 1\n'
        'log_interval = 1\neval_iters = 0\n[checkpoint]\nsave = false\nresume = "never"\n'
    )
    coretrain = [sys.executable, "-m", "coretrain"]
    env = {"PYTHONPATH": str(here)}
    help_s = wall([*coretrain, "--help"])
    python_s = wall([sys.executable, "-c", "pass"])
    torch_s = wall([sys.executable, "-c", "import torch"])
    first_step_s = wall([*coretrain, "run", str(config_path)], repeat=3, env=env)
    hand_step = (
        "import torch, overhead; torch.set_num_threads(1); m = overhead.MLP(); d = overhead.Tensors(); "
        "o = torch.optim.AdamW(m.parameters(), lr=1e-3); m(*d.get_batch(torch.arange(32))).backward(); o.step()"
    )
    hand_step_s = wall([sys.executable, "-c", hand_step], repeat=3, env=env)
    print("\nstartup (median wall time of fresh processes)")
    print(f"  python -c pass                 {python_s * 1e3:7.0f} ms")
    print(f"  coretrain --help               {help_s * 1e3:7.0f} ms   (target <= 300 ms)")
    print(f"  python -c 'import torch'       {torch_s * 1e3:7.0f} ms")
    print(
        f"  hand-written 1 step (MLP)      {hand_step_s * 1e3:7.0f} ms   "
        "(torch.optim's first use imports torch._dynamo)"
    )
    print(
        f"  coretrain run (1 step, MLP)    {first_step_s * 1e3:7.0f} ms   time to first step and exit: "
        f"{1e3 * (first_step_s - hand_step_s):+.0f} ms over the hand-written script"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # tiny gradients must not make one loop's math slower than the other's
    hand, core = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds + 1):  # round 0 warms up both and is discarded
            with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
                h = hand_written(args.steps)
                c = with_coretrain(args.steps, f"{tmp}/run{i}")
            if i:
                hand.append(h)
                core.append(c)
        h, c = statistics.median(hand) * 1e6, statistics.median(core) * 1e6
        paired = statistics.median((b - a) * 1e6 for a, b in zip(hand, core))  # per-round pairs cancel drift
        print(
            f"per-step overhead, {args.rounds} interleaved rounds x {args.steps} steps "
            f"(MLP {WIDTH}-wide, batch {BATCH}, CPU, 1 thread)"
        )
        print(f"  hand-written loop   {h:8.1f} us/step   (rounds: {', '.join(f'{x * 1e6:.1f}' for x in hand)})")
        print(f"  coretrain run       {c:8.1f} us/step   (rounds: {', '.join(f'{x * 1e6:.1f}' for x in core)})")
        print(
            f"  overhead            {paired:+8.1f} us/step   ratio {c / h:.3f}   (median of per-round differences; "
            "target <= +10 us/step)"
        )
        startup(tmp)


if __name__ == "__main__":
    sys.modules.setdefault("overhead", sys.modules[__name__])
    main()
