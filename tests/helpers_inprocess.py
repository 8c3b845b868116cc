"""Build and train runs in this process with tiny synthetic models and data (unit tests)."""

from __future__ import annotations

from typing import Any

import torch

from coretrain.config import Config
from coretrain.configload import structure
from coretrain.loop import Trainer
from coretrain.pluginmanager import load_plugins
from coretrain.run import Datasets, Run, build_run


class Regression(torch.nn.Module):
    """A 2-layer MLP returning its MSE loss, so ``model(x, y)`` is the loss."""

    def __init__(self, width: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(width, 1)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x), y)


class TensorPairs:
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def make_model(width: int = 16, dropout: float = 0.0) -> torch.nn.Module:
    return Regression(width, dropout)


def make_data(context: Any, samples: int = 256, valid: bool = True, dead_inputs: int = 0) -> Datasets:
    """``dead_inputs``: that many input features are always 0 (their first-layer weights get no gradient)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=g)
    x[:, :dead_inputs] = 0.0
    y = 0.5 * x.sum(dim=1, keepdim=True)
    return Datasets(train=TensorPairs(x, y), valid=TensorPairs(x[:64], y[:64]) if valid else None)


def config(tmp_path: Any, **sections: dict[str, Any]) -> Config:
    raw: dict[str, Any] = {
        "run": {"output_dir": str(tmp_path / "out"), "seed": 7},
        "model": {"provider": "helpers_inprocess:make_model"},
        "data": {"provider": "helpers_inprocess:make_data"},
        "train": {"micro_batch_size": 8, "train_iters": 10, "log_interval": 2, "eval_iters": 0},
        "optimizer": {"lr": 0.01},
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return structure(raw, Config)


def build(cfg: Config, *extra_plugins: tuple[str, object]) -> Run:
    plugins = load_plugins(cfg)  # real entry points; tests turn autoload off
    for name, plugin in extra_plugins:
        plugins.register(name, plugin)
    plugins.check_pending()
    return build_run(cfg, plugins)


def train(cfg: Config, *extra_plugins: tuple[str, object]) -> tuple[Run, int]:
    run = build(cfg, *extra_plugins)
    code = Trainer(run).train()
    return run, code
