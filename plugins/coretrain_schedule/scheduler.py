"""The schedule's arithmetic: Megatron's OptimizerParamScheduler, counted in samples."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from coretrain import UserError

if TYPE_CHECKING:
    from coretrain_schedule import Schedule


class ParamScheduler:
    """Warmup to ``lr``, then constant / linear / cosine / inverse-square-root / WSD decay to
    ``min_lr``; optionally weight decay from start to end. Megatron's formulas, in samples.

    The rates of update u are Megatron's after u updates' samples: warmup's first update uses
    lr·1/warmup (Megatron's uses 0, the rate before any sample), the update that ends the decay
    span uses min_lr. Progress is counted in samples, so a batch size that ramps up moves the
    schedule by the samples it really used. A param group may carry its own ``max_lr`` /
    ``min_lr`` and an ``lr_mult`` (optimizer-overrides); a group without weight decay keeps none.
    Kept apart from torch's LRScheduler to stay a few float ops per step with a plain-dict
    state. Vetoed updates do not move it.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, cfg: Schedule, max_lr: float, total_samples: int, batch: int
    ) -> None:
        self.optimizer, self.cfg, self.max_lr, self.global_batch_size = optimizer, cfg, max_lr, batch
        self.decay = cfg.decay_samples or (cfg.decay_iters or 0) * batch or max(total_samples, 1)
        self.warmup = (
            cfg.warmup_samples
            if cfg.warmup_samples is not None
            else cfg.warmup_iters * batch or round((cfg.warmup_fraction or 0.0) * self.decay)
        )
        self.wsd_decay = cfg.wsd_decay_samples or (cfg.wsd_decay_iters or 0) * batch
        self.never_decays = self.warmup >= self.decay and cfg.decay_style != "constant"
        if self.never_decays and (cfg.decay_iters or cfg.decay_samples):  # Megatron asserts it
            raise UserError(
                f"plugins.schedule: the warmup ({self.warmup:,} samples) is not shorter than the decay it starts "
                f"(decay_iters / decay_samples: {self.decay:,} samples), so the rate would never decay; "
                "shorten warmup_iters (or warmup_samples / warmup_fraction), lengthen the decay, or set "
                'decay_style = "constant"'
            )
        self.total = max(total_samples, 1)
        self.samples = 0
        self._applied: tuple[str, float, float | None] | None = None
        self._apply()

    def shape(self, samples: float) -> tuple[str, float]:
        """How the rate after ``samples`` follows from a group's (max, min): (kind, coefficient)."""
        cfg, warmup = self.cfg, self.warmup
        if warmup and samples <= warmup:
            return "peak", samples / warmup
        if cfg.decay_style == "constant":
            return "peak", 1.0
        if samples > self.decay:
            return "between", 0.0
        if cfg.decay_style == "inverse-square-root":
            return "floor", math.sqrt(max(warmup, 1)) / math.sqrt(max(samples, 1))
        ratio = (samples - warmup) / (self.decay - warmup)
        if cfg.decay_style == "linear":
            return "between", 1.0 - ratio
        if cfg.decay_style == "cosine":
            return "between", 0.5 * (math.cos(math.pi * ratio) + 1.0)
        anneal_start = self.decay - self.wsd_decay
        if samples <= anneal_start:
            return "between", 1.0
        return "between", wsd_coefficient(cfg.wsd_decay_style, (samples - anneal_start) / self.wsd_decay)

    def weight_decay_at(self, samples: float) -> float | None:
        """Megatron's get_wd after ``samples``; None without a weight-decay schedule."""
        start, end = self.cfg.start_weight_decay, self.cfg.end_weight_decay
        if start is None or end is None:
            return None
        if samples > self.total or self.cfg.weight_decay_incr_style == "constant":
            return end
        ratio = samples / self.total
        coefficient = (
            ratio if self.cfg.weight_decay_incr_style == "linear" else 0.5 * (math.cos(math.pi * (1 - ratio)) + 1)
        )
        return start + coefficient * (end - start)

    def lr_at(self, update: float, max_lr: float | None = None, min_lr: float | None = None) -> float:
        """Learning rate of the ``update``-th (1-based, in full global batches) update."""
        top = self.max_lr if max_lr is None else max_lr
        low = self.cfg.min_lr if min_lr is None else min_lr
        return _rate(*self.shape(update * self.global_batch_size), top, low)

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

    @property
    def last_weight_decay(self) -> float | None:
        """The scheduled weight decay of the latest update; None without a schedule."""
        return self.weight_decay_at(max(self.samples, self.global_batch_size))

    def _apply(self) -> None:
        upcoming = self.samples + self.global_batch_size
        kind, coefficient = self.shape(upcoming)
        weight_decay = self.weight_decay_at(upcoming)
        if (kind, coefficient, weight_decay) == self._applied:  # a constant stretch: the groups hold these
            return
        self._applied = kind, coefficient, weight_decay
        for group in self.optimizer.param_groups:
            top = group.setdefault("max_lr", self.max_lr)
            low = group.setdefault("min_lr", self.cfg.min_lr)
            group["lr"] = _rate(kind, coefficient, top, low) * group.setdefault("lr_mult", 1.0)
            if weight_decay is not None:
                group["weight_decay"] = weight_decay * group.setdefault("wd_mult", float(group["weight_decay"] > 0))

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


def wsd_coefficient(style: str, ratio: float) -> float:
    """Megatron's shapes of WSD's final decay, 1 at its start and 0 at its end."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    return 1.0 - math.sqrt(ratio)  # minus_sqrt


def _rate(kind: str, coefficient: float, top: float, low: float) -> float:
    """A share of the peak (warmup, constant), between min and peak, or the peak's share floored at min."""
    if kind == "peak":
        return top * coefficient
    if kind == "floor":
        return max(low, top * coefficient)
    return low + (top - low) * coefficient
