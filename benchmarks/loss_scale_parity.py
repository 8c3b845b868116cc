"""Does the ``loss-scale`` plugin's scaler move its scale as Megatron-Core's ``DynamicGradScaler``?

    python -m venv /tmp/mc && /tmp/mc/bin/pip install torch==2.13.0 megatron-core==0.16.1 \
        pluggy attrs cattrs tomli tomli-w rich
    PYTHONPATH=. /tmp/mc/bin/python benchmarks/loss_scale_parity.py --patterns 200

Random overflow patterns (5–60 steps, overflow rates 0.1–0.6) with random initial scales
(2**4–2**32), floors, windows and hysteresis. Megatron's scaler is told each step's overflow
(its ``update(found_inf)``); ours finds it as training does: a gradient set to inf, then
``unscale_``, ``step`` and ``update``. Megatron's scaler builds its tensors on CUDA: here they
are built on the CPU. Prints how many patterns gave the same scale after every step.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))

from coretrain_loss_scale import MegatronGradScaler  # noqa: E402


def megatron_scales(pattern: list[bool], initial: float, minimum: float, window: int, hysteresis: int) -> list[float]:
    import megatron.core.optimizer.grad_scaler as grad_scaler

    real = torch.tensor
    grad_scaler.torch.tensor = lambda *args, device=None, **kwargs: real(*args, **kwargs)  # type: ignore[misc]
    try:
        scaler = grad_scaler.DynamicGradScaler(initial, minimum, 2.0, 0.5, window, hysteresis)
    finally:
        grad_scaler.torch.tensor = real
    scales = []
    for overflowed in pattern:
        scaler.update(overflowed)
        scales.append(float(scaler.scale))
    return scales


def our_scales(
    pattern: list[bool], initial: float, minimum: float, window: int, hysteresis: int, static: bool = False
) -> list[float]:
    """The scale after each step, the overflows made as training meets them (tests/test_loss_scale.py too)."""
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.0)
    scaler = MegatronGradScaler("cpu", initial, minimum, window, hysteresis, static=static)
    scales = []
    for overflowed in pattern:
        optimizer.zero_grad()
        scaler.scale(weight.sum()).backward()
        if overflowed:
            weight.grad[1] = float("inf")  # type: ignore[index]
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patterns", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    equal = 0
    for _ in range(args.patterns):
        rate = rng.choice([0.1, 0.3, 0.6])
        pattern = [rng.random() < rate for _ in range(rng.randint(5, 60))]
        setting = (
            2.0 ** rng.randint(4, 32),
            2.0 ** rng.randint(0, 3) + rng.choice([0, 0.5]),
            rng.randint(1, 5),
            rng.randint(1, 4),
        )
        ours, theirs = our_scales(pattern, *setting), megatron_scales(pattern, *setting)
        equal += ours == theirs
        if ours != theirs:
            print(f"differs: setting {setting}, pattern {pattern}:\n  ours     {ours}\n  megatron {theirs}")
    print(f"{equal} of {args.patterns} overflow patterns: the same scale after every step")


if __name__ == "__main__":
    main()
