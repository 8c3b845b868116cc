"""``gc``: manual garbage collection, as Megatron's manual_gc / manual_gc_interval / manual_gc_eval.

Python's automatic collector runs whenever allocations pass a threshold, i.e. at a random
point of some step on some rank; on many ranks that makes every step as slow as the rank that
happened to collect. This plugin turns automatic collection off at train start and collects
on the same step on every rank (steps are global), before and after evaluation when asked,
and can ``gc.freeze()`` the long-lived heap after warm-up so later collections skip it.
Automatic collection is restored when training ends.
"""

from __future__ import annotations

import gc
import logging

from attrs import define, field

from coretrain import Every, Run, hookimpl, non_negative

log = logging.getLogger("coretrain")


@define(kw_only=True)
class GC:
    """Disable automatic GC; collect every `interval` steps on every rank at once."""

    interval: int = field(default=100, validator=non_negative)
    """Full collection every N steps; 0 = never collect (automatic GC stays off)."""
    eval: bool = True
    """Also collect right before and right after each validation."""
    freeze_after_warmup: int | None = field(default=None, validator=non_negative)
    """gc.freeze() after this step: objects alive then are never scanned again."""
    collections: int = field(default=0, init=False)
    _was_enabled: bool = field(default=True, init=False, repr=False)

    def _collect(self) -> None:
        gc.collect()
        self.collections += 1

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._collect()

    @hookimpl
    def post_step(self, run: Run, step: int) -> None:
        due = Every(self.interval)(step)
        eval_next = self.eval and run.cadence.evaluates(step)
        if due or eval_next:
            self._collect()
        if self.freeze_after_warmup is not None and step == self.freeze_after_warmup:
            gc.freeze()
            log.info("gc: froze %d objects after step %d", gc.get_freeze_count(), step)

    @hookimpl
    def on_eval(self) -> None:
        if self.eval:
            self._collect()

    @hookimpl
    def on_train_end(self) -> None:
        if self.freeze_after_warmup is not None:
            gc.unfreeze()
        if self._was_enabled:
            gc.enable()
