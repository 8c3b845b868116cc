"""Optimizer by name with per-parameter overrides, and Megatron-style warmup + decay LR."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from coretrain.config import OptimizerConfig, SchedulerConfig

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def build_optimizer(
    cfg: OptimizerConfig, model: torch.nn.Module, overrides: Mapping[str, Mapping[str, float]]
) -> torch.optim.Optimizer:
    """One param group per distinct override set; ``lr_mult`` is kept on the group for the schedule."""
    groups: dict[tuple[tuple[str, float], ...], dict[str, Any]] = {}
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
    optimizer: torch.optim.Optimizer = OPTIMIZERS[cfg.name](
        list(groups.values()), lr=cfg.lr, weight_decay=cfg.weight_decay, **options
    )
    return optimizer


class WarmupDecayLR:
    """Linear warmup to ``lr`` over warmup_iters, then constant/linear/cosine decay to min_lr.

    Progress is counted in samples and measured in full global batches, so a batch size that
    ramps up (Megatron's rampup_batch_size) moves the schedule by the samples it really used;
    with a constant batch, position u is simply the u-th update. Update u (1-based) of warmup
    uses lr·u/warmup_iters (never 0, unlike Megatron's first step); the first update after
    warmup uses ``lr`` and update ``decay_iters`` uses min_lr. A param group may carry its own
    ``max_lr`` / ``min_lr`` and an ``lr_mult`` (see the optimizer-overrides plugin).

    Kept separate from torch's LRScheduler to stay a few float ops per step and to make its
    state a plain dict. Vetoed updates do not move it.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        cfg: SchedulerConfig,
        max_lr: float,
        train_iters: int,
        global_batch_size: int = 1,
    ) -> None:
        self.optimizer, self.cfg, self.max_lr = optimizer, cfg, max_lr
        self.decay_iters = cfg.decay_iters or max(train_iters, 1)
        self.global_batch_size = global_batch_size
        self.samples = 0
        self._applied: tuple[bool, float] | None = None
        self._apply()

    def factors(self, update: float) -> tuple[bool, float]:
        """(in warmup, fraction): lr = max·fraction in warmup, else min + (max − min)·fraction."""
        cfg = self.cfg
        if cfg.warmup_iters and update <= cfg.warmup_iters:
            return True, update / cfg.warmup_iters
        if cfg.decay_style == "constant":
            return False, 1.0
        span = max(self.decay_iters - cfg.warmup_iters - 1, 1)
        progress = min(max((update - cfg.warmup_iters - 1) / span, 0.0), 1.0)
        if cfg.decay_style == "linear":
            return False, 1.0 - progress
        return False, 0.5 * (1.0 + math.cos(math.pi * progress))

    def lr_at(self, update: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """Learning rate of the ``update``-th (1-based, in full global batches) update."""
        top = self.max_lr if max_lr is None else max_lr
        low = self.cfg.min_lr if min_lr is None else min_lr
        return _rate(*self.factors(update), top, low)

    @property
    def position(self) -> float:
        """Full global batches' worth of samples used by updates so far."""
        return self.samples / self.global_batch_size

    @property
    def last_lr(self) -> float:
        """The base learning rate of the latest update (of the first, before any)."""
        return self.lr_at(max(self.position, 1.0))

    def last_group_lrs(self) -> list[float]:
        """The learning rate of the latest update in each param group (its own max/min and ``lr_mult``)."""
        update = max(self.position, 1.0)
        return [
            self.lr_at(update, group.get("max_lr"), group.get("min_lr")) * group.get("lr_mult", 1.0)
            for group in self.optimizer.param_groups
        ]

    def _apply(self) -> None:
        factors = self.factors(self.position + 1)
        if factors == self._applied:  # a constant stretch: the groups already hold these rates
            return
        self._applied = warmup, fraction = factors
        for group in self.optimizer.param_groups:
            top = group.setdefault("max_lr", self.max_lr)
            low = group.setdefault("min_lr", self.cfg.min_lr)
            group["lr"] = _rate(warmup, fraction, top, low) * group.setdefault("lr_mult", 1.0)

    def step(self, samples: int | None = None) -> None:
        """One update used ``samples`` samples (default: a full global batch)."""
        self.samples += self.global_batch_size if samples is None else samples
        self._apply()

    def state_dict(self) -> dict[str, int]:
        return {"samples": self.samples}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.samples = int(state["samples"])
        self._applied = None
        self._apply()


def _rate(warmup: bool, fraction: float, top: float, low: float) -> float:
    """The schedule's one formula: a fraction of the peak in warmup, else between min and peak."""
    return top * fraction if warmup else low + (top - low) * fraction
