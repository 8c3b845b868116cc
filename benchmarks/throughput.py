"""Tokens/s and MFU of the ``gpt`` provider: coretrain against a hand-written loop.

    python benchmarks/throughput.py                                   # CPU: small sizes
    python benchmarks/throughput.py --device cuda --sizes 124M,350M --precision bf16 --compile

Same model, data (random tokens), optimizer (AdamW), precision and compile setting for both;
rounds alternate in one process. Each round runs ``--steps`` steps and times all but the
first (warm-up, compilation). MFU = model FLOP/s (6N + 12·L·C·T per token, the gpt
provider's flops_per_token) / the device's peak, from a table of known GPUs or --peak-tflops.
Target: coretrain ≥ 0.98 × the hand-written loop's tokens/s.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
from coretrain_gpt.model import GPT, GPTConfig
from coretrain_timers import PEAK_BF16_TFLOPS
from coretrain_windows import TokenWindows

from coretrain import hookimpl
from coretrain.build import build_run, close_run
from coretrain.config import Config
from coretrain.configload import structure
from coretrain.loop import Trainer
from coretrain.pluginmanager import load_plugins
from coretrain.run import Datasets

SIZES = {  # name: (n_layer, n_head, n_embd, seq_length, micro_batch)
    "tiny": (4, 4, 128, 128, 16),
    "small": (6, 6, 384, 256, 8),
    "124M": (12, 12, 768, 1024, 16),
    "350M": (24, 16, 1024, 1024, 8),
}
VOCAB = 50304
CURRENT: dict[str, Any] = {}


def make_model() -> torch.nn.Module:
    n_layer, n_head, n_embd, seq, _ = CURRENT["size"]
    return GPT(
        GPTConfig(
            vocab_size=VOCAB, block_size=seq, n_layer=n_layer, n_head=n_head, n_embd=n_embd, dropout=0.0, bias=False
        )
    )


def make_data() -> Datasets:
    seq = CURRENT["size"][3]
    tokens = torch.randint(0, VOCAB, (seq * 4096 + 1,), generator=torch.Generator().manual_seed(0))
    return Datasets(train=TokenWindows(tokens, seq), seq_length=seq, vocab_size=VOCAB)


class StepClock:
    """Times steps 2..N of a coretrain run with the same clock the hand loop uses."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.start, self.end = device, 0.0, 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    @hookimpl
    def post_step(self, step: int, run: Any) -> None:
        if step == 1:
            self._sync()
            self.start = time.perf_counter()
        elif step == run.config.train.train_iters:
            self._sync()
            self.end = time.perf_counter()


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def hand_written(steps: int, device: torch.device, precision: str, compiled: bool) -> float:
    """Seconds for steps 2..N of the loop a person writes."""
    torch.manual_seed(0)
    model = make_model().to(device)
    if compiled:
        model.compile()
    data = make_data().train
    micro = CURRENT["size"][4]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, betas=(0.9, 0.95))
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))
    start = 0.0
    for step in range(1, steps + 1):
        x, y = data.get_batch(perm[(step - 1) * micro : step * micro])
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, precision):
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 1 or step == steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step == 1:
                start = time.perf_counter()
    return time.perf_counter() - start


def with_coretrain(steps: int, device: torch.device, precision: str, compiled: bool, tmp: str) -> float:
    micro = CURRENT["size"][4]
    raw: dict[str, Any] = {
        "run": {"output_dir": tmp, "device": device.type, "precision": precision, "seed": 0},
        "model": {"provider": "throughput:make_model"},
        "data": {"provider": "throughput:make_data"},
        "train": {"micro_batch_size": micro, "train_iters": steps, "log_interval": max(steps // 2, 1), "eval_iters": 0},
        "optimizer": {"lr": 3e-4, "weight_decay": 0.1, "betas": [0.9, 0.95]},
        "checkpoint": {"save": False, "resume": "never"},
        "plugins": {"schedule": {"decay_style": "constant"}, **({"compile": {}} if compiled else {})},
    }
    cfg = structure(raw, Config)
    plugins = load_plugins(cfg)
    clock = StepClock(device)
    plugins.register("clock", clock)
    trainer = Trainer(build_run(cfg, plugins))
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    close_run(trainer.run, failing=False)
    return clock.end - clock.start


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given:
        return given
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default=None, help=f"comma-separated from {list(SIZES)}")
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    sizes = (args.sizes or ("124M,350M" if device.type == "cuda" else "tiny,small")).split(",")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    steps = args.steps or (50 if device.type == "cuda" else 12)
    sys.modules.setdefault("throughput", sys.modules[__name__])
    os.environ["CORETRAIN_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    peak = peak_tflops(device, args.peak_tflops)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    print(
        f"device: {label}; precision {precision}; compile {args.compile}; {steps} steps/round "
        f"(first excluded), {args.rounds} interleaved rounds; peak {peak or 'unknown'} TFLOP/s"
    )
    print(
        f"{'size':>6} {'params':>8} {'hand tok/s':>12} {'coretrain tok/s':>16} {'ratio':>7} {'TFLOP/s':>8} {'MFU':>6}"
    )
    for size in sizes:
        CURRENT["size"] = SIZES[size]
        n_layer, _, n_embd, seq, micro = SIZES[size]
        model = make_model()
        params, flops_per_token = sum(p.numel() for p in model.parameters()), model.flops_per_token()
        del model
        tokens = (steps - 1) * micro * seq
        hand, core = [], []
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.rounds):
                hand.append(tokens / hand_written(steps, device, precision, args.compile))
                core.append(tokens / with_coretrain(steps, device, precision, args.compile, f"{tmp}/{i}"))
        h, c = statistics.median(hand), statistics.median(core)
        achieved = c * flops_per_token / 1e12
        mfu = f"{achieved / peak:6.1%}" if peak else "   n/a"
        print(f"{size:>6} {params / 1e6:7.1f}M {h:12,.0f} {c:16,.0f} {c / h:7.3f} {achieved:8.2f} {mfu}")


if __name__ == "__main__":
    main()
