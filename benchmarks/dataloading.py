"""Input-bound training: coretrain's DataLoader workers against a hand-written loop with the same DataLoader.

    python benchmarks/dataloading.py [--rounds 5] [--steps 100] [--workers 2] [--delay-ms 1]

A map-style dataset that spends ``--delay-ms`` of "I/O" per sample (a sleep, as a network
read or a JPEG decode would), batch 32, a small CNN, AdamW, one training thread. Rounds
alternate, in one process: the hand-written loop with ``DataLoader(num_workers=N,
prefetch_factor=2)``, coretrain with ``data.num_workers = N``, and coretrain with no
workers (batches read on the training thread). Each time includes creating the workers,
as it does for both loops in real use. Reported: median ms/step of each, coretrain's
throughput as a share of the hand loop's (goal >= 0.98), and workers against none.
"""

from __future__ import annotations

import argparse
import statistics
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

BATCH, SAMPLES, CLASSES = 32, 32 * 1024, 10
DELAY = 0.001


class SlowImages(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """8×8 images and labels; every sample read costs DELAY seconds."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.labels = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
        self.images = torch.randn(SAMPLES, 1, 8, 8, generator=g) + self.labels.view(-1, 1, 1, 1) * 0.1

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(DELAY)
        return self.images[index], self.labels[index]


class CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(16 * 64, CLASSES)
        )

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(images), labels)


def make_model() -> torch.nn.Module:
    return CNN()


def make_data() -> Datasets:
    return Datasets(train=SlowImages())


def hand_written(steps: int, workers: int) -> float:
    """The loop a person writes around a DataLoader with workers."""
    torch.manual_seed(0)
    model = CNN()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    start = time.perf_counter()
    loader = torch.utils.data.DataLoader(
        SlowImages(),
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        prefetch_factor=2 if workers else None,
        drop_last=True,
    )
    batches = iter(loader)
    for _ in range(steps):
        images, labels = next(batches)
        loss = model(images, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    loss.item()
    del batches
    return (time.perf_counter() - start) / steps


def with_coretrain(steps: int, workers: int, output_dir: str) -> float:
    cfg = structure(
        {
            "run": {"output_dir": output_dir, "seed": 0},
            "model": {"provider": f"{__name__}:make_model"},
            "data": {"provider": f"{__name__}:make_data", "num_workers": workers},
            "train": {"micro_batch_size": BATCH, "train_iters": steps, "log_interval": steps, "eval_iters": 0},
            "optimizer": {"lr": 1e-3},
            "checkpoint": {"save": False, "resume": "never"},
            "plugins": {"progress": {"enabled": False}, "schedule": {"decay_style": "constant"}},
        },
        Config,
    )
    trainer = Trainer(build_run(cfg, load_plugins(cfg)))
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start
    close_run(trainer.run, failing=False)
    return elapsed / steps


def main(argv: list[str] | None = None) -> None:
    global DELAY
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--delay-ms", type=float, default=1.0)
    args = parser.parse_args(argv)
    DELAY = args.delay_ms / 1000
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    times: dict[str, list[float]] = {"hand": [], "coretrain": [], "none": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            times["hand"].append(hand_written(args.steps, args.workers))
            times["coretrain"].append(with_coretrain(args.steps, args.workers, f"{tmp}/w{i}"))
            times["none"].append(with_coretrain(args.steps, 0, f"{tmp}/n{i}"))
    hand, ours, none = (statistics.median(times[k]) * 1e3 for k in ("hand", "coretrain", "none"))
    print(
        f"input-bound training, {args.rounds} interleaved rounds x {args.steps} steps "
        f"(batch {BATCH}, {args.delay_ms:g} ms per sample, {args.workers} workers, CPU)"
    )
    print(f"  hand-written loop, DataLoader  {hand:7.2f} ms/step")
    print(
        f"  coretrain, data.num_workers    {ours:7.2f} ms/step   throughput {hand / ours:.3f} of the hand loop's "
        "(goal >= 0.98)"
    )
    print(f"  coretrain, no workers          {none:7.2f} ms/step   workers are {none / ours:.2f}x faster")


if __name__ == "__main__":
    main()
