"""``schedule``: the learning-rate and weight-decay schedule, on by default (``[plugins.schedule]``).

Megatron's OptimizerParamScheduler, counted in samples: warmup to ``optimizer.lr``, then
constant / linear / cosine / inverse-square-root / WSD decay to ``min_lr``; optionally weight
decay from ``start_weight_decay`` to ``end_weight_decay``. The plugin answers
``configure_scheduler`` with a :class:`~coretrain_schedule.scheduler.ParamScheduler`; the core
advances it by each update's samples, saves and restores its position. It logs ``lr``,
``lr/groupN`` (param groups with their own rates) and ``weight_decay`` (when scheduled).
Disable it (``enabled = false``) for a constant ``optimizer.lr``, or answer
``configure_scheduler`` with a scheduler of your own.

Formerly the core's ``[scheduler]`` table: it still works, with one deprecation warning.
"""

from __future__ import annotations

import logging
from typing import Literal

from attrs import define, field

from coretrain import FieldValueError, Run, Scheduler, fraction, hookimpl, non_negative, positive
from coretrain_schedule.scheduler import ParamScheduler

log = logging.getLogger("coretrain")


@define(kw_only=True)
class Schedule:
    """Warmup, then a decay to min_lr, and optionally a weight-decay schedule: Megatron's
    OptimizerParamScheduler (its --lr-* names without the prefix). Counted in samples; a key in
    iterations means that many global batches."""

    warmup_iters: int = field(default=0, validator=non_negative)
    """Steps of linear warmup from 0 to the peak rate."""
    warmup_samples: int | None = field(default=None, validator=non_negative)
    """Warmup counted in samples instead."""
    warmup_fraction: float | None = field(default=None, validator=fraction)
    """Warmup as a share of the decay span (decay_iters / decay_samples / the whole run)."""
    decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "cosine"
    """After warmup. "WSD": warmup, stable at lr, then the last wsd_decay_iters decay to min_lr."""
    decay_iters: int | None = field(default=None, validator=positive)
    """Steps from start to the end of decay; unset = the whole run (train_iters or train_samples)."""
    decay_samples: int | None = field(default=None, validator=positive)
    """decay_iters counted in samples instead."""
    wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "exponential"
    """The shape of WSD's final decay (Megatron's default: exponential)."""
    wsd_decay_iters: int | None = field(default=None, validator=positive)
    """WSD: steps of the final decay, ending at decay_iters."""
    wsd_decay_samples: int | None = field(default=None, validator=positive)
    """wsd_decay_iters counted in samples instead."""
    min_lr: float = field(default=0.0, validator=non_negative)
    """Where the decay ends (and stays)."""
    start_weight_decay: float | None = field(default=None, validator=non_negative)
    """With end_weight_decay: weight decay goes from this to that over the run (param groups
    without weight decay keep none); unset = optimizer.weight_decay throughout."""
    end_weight_decay: float | None = field(default=None, validator=non_negative)
    """The weight decay at the end of the run (see start_weight_decay)."""
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = "constant"
    """How weight decay goes from start_weight_decay to end_weight_decay."""

    def __attrs_post_init__(self) -> None:
        for name in ("warmup", "decay", "wsd_decay"):
            if getattr(self, f"{name}_iters") and getattr(self, f"{name}_samples") is not None:
                raise FieldValueError(f"{name}_samples", f"set {name}_iters or {name}_samples, not both")
        if self.warmup_fraction is not None and (self.warmup_iters or self.warmup_samples is not None):
            raise FieldValueError("warmup_fraction", "set one of warmup_iters, warmup_samples, warmup_fraction")
        if self.decay_style == "WSD" and self.wsd_decay_iters is None and self.wsd_decay_samples is None:
            raise FieldValueError("wsd_decay_iters", 'decay_style = "WSD" needs the steps of its final decay')
        start, end = self.start_weight_decay, self.end_weight_decay
        if (start is None) != (end is None):
            raise FieldValueError("end_weight_decay", "set start_weight_decay and end_weight_decay together")
        if self.weight_decay_incr_style == "constant" and start != end:
            raise FieldValueError(
                "weight_decay_incr_style", 'is "constant" but start and end weight decay differ: "linear" or "cosine"?'
            )

    @hookimpl
    def configure_scheduler(self, run: Run) -> Scheduler:
        total = run.config.train.train_samples or run.train_iters * run.global_batch_size
        scheduler = ParamScheduler(run.optimizer, self, run.config.optimizer.lr, total, run.global_batch_size)
        if scheduler.never_decays and run.dist.is_main:  # the decay spans the run: a short smoke run of a config
            log.warning(
                "schedule: this run (%s samples) is not longer than its warmup (%s): the rate never decays",
                f"{scheduler.decay:,}",
                f"{scheduler.warmup:,}",
            )
        return scheduler

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        """A resume past the end of a decay that spans the run — the checkpoint trained with a
        larger global batch, so its samples reach further than this run's steps × batch — trains
        its steps left at ``min_lr``: said once, with what keeps the decay."""
        scheduler = run.scheduler
        own_length = self.decay_iters is None and self.decay_samples is None and self.decay_style != "constant"
        if not (isinstance(scheduler, ParamScheduler) and own_length and run.dist.is_main):
            return
        left = run.train_iters - run.state.step
        if left > 0 and scheduler.samples >= scheduler.decay:
            log.warning(
                "schedule: the rate decays over the run's %s samples (train_iters %s x global batch %s), but it "
                "resumed at %s samples consumed (the checkpoint's batch was larger?): its %s step(s) left train at "
                "min_lr %s. Set train.global_batch_size to the checkpoint's batch, or [plugins.schedule] "
                "decay_samples",
                f"{scheduler.decay:,}",
                run.train_iters,
                run.global_batch_size,
                f"{scheduler.samples:,}",
                left,
                self.min_lr,
            )

    @hookimpl(tryfirst=True)  # the rates join the interval's metrics before any backend sees them
    def on_log(self, run: Run, metrics: dict[str, float]) -> None:
        """``lr``; ``lr/groupN`` when param groups have their own rates (optimizer-overrides);
        ``weight_decay`` when it is scheduled. A plugin that drives the rate itself (lr-find)
        says its own ``lr``."""
        scheduler = run.scheduler
        if not isinstance(scheduler, ParamScheduler):
            return
        rates = {"lr": scheduler.last_lr}
        if (weight_decay := scheduler.last_weight_decay) is not None:
            rates["weight_decay"] = weight_decay
        group_lrs = scheduler.last_group_lrs()
        if len(set(group_lrs)) > 1:
            rates.update({f"lr/group{index}": lr for index, lr in enumerate(group_lrs)})
        for name, value in rates.items():
            metrics.setdefault(name, value)
