"""Optimizer by name with per-parameter overrides, and Megatron-style warmup + decay LR."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from coretrain.config import OptimizerConfig, SchedulerConfig

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def build_optimizer(cfg: OptimizerConfig, model: torch.nn.Module,
                    overrides: Mapping[str, Mapping[str, float]]) -> torch.optim.Optimizer:
    """One param group per distinct override set; ``lr_mult`` is kept on the group for the schedule."""
    groups: dict[tuple, dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        override = dict(overrides.get(name, {}))
        key = tuple(sorted(override.items()))
        group = groups.setdefault(key, {"params": [], "lr_mult": 1.0, **override})
        group["params"].append(param)
    if cfg.name == "sgd":
        options: dict[str, Any] = {"momentum": cfg.momentum}
    else:
        options = {"betas": cfg.betas, "eps": cfg.eps}
    return OPTIMIZERS[cfg.name](list(groups.values()), lr=cfg.lr, weight_decay=cfg.weight_decay, **options)


class WarmupDecayLR:
    """Linear warmup to ``lr`` over warmup_iters, then constant/linear/cosine decay to min_lr.

    Update u (1-based) of warmup uses lr·u/warmup_iters (never 0, unlike Megatron's first
    step); the first update after warmup uses ``lr`` and update ``decay_iters`` uses min_lr.

    ``updates`` counts optimizer updates done; the rate set on the groups is the one the next
    update uses. Kept separate from torch's LRScheduler to stay a few float ops per step and
    to make its state a plain dict.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, max_lr: float, train_iters: int) -> None:
        self.optimizer, self.cfg, self.max_lr = optimizer, cfg, max_lr
        self.decay_iters = cfg.decay_iters or max(train_iters, 1)
        self.updates = 0
        self._apply()

    def lr_at(self, update: int) -> float:
        """Learning rate of the ``update``-th update (1-based)."""
        cfg = self.cfg
        if cfg.warmup_iters and update <= cfg.warmup_iters:
            return self.max_lr * update / cfg.warmup_iters
        if cfg.decay_style == "constant":
            return self.max_lr
        span = max(self.decay_iters - cfg.warmup_iters - 1, 1)
        progress = min(max((update - cfg.warmup_iters - 1) / span, 0.0), 1.0)
        if cfg.decay_style == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr + (self.max_lr - cfg.min_lr) * factor

    @property
    def lr(self) -> float:
        return self.lr_at(self.updates + 1)

    def _apply(self) -> None:
        lr = self.lr
        for group in self.optimizer.param_groups:
            group.setdefault("lr_mult", 1.0)
            group["lr"] = lr * group["lr_mult"]

    def step(self) -> None:
        self.updates += 1
        lr = self.lr_at(self.updates + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_mult"]

    def state_dict(self) -> dict[str, int]:
        return {"updates": self.updates}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.updates = int(state["updates"])
        self._apply()
