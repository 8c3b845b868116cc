"""The learning-rate range test (Smith 2015; Lightning's ``Tuner.lr_find``, fastai's ``lr_find``).

Each step trains at a learning rate that grows exponentially from ``min_lr`` to ``max_lr``, on
Lightning's schedule (:meth:`LRFinder.lr_at`);
the loss is smoothed as Lightning smooths it (an exponential moving average, beta 0.98, its bias
corrected by ``1 - beta ** (n + 1)`` after the n-th step: Lightning divides by its
``global_step + 1``, which its loop has already advanced past the step, an off-by-one kept here
so that the curves are Lightning's) and the test stops once the smoothed loss exceeds
``diverge`` times its lowest value, from the second step on (Lightning's ``early_stop_threshold``). Three
suggestions, each a rule of its own: ``steepest``, where the smoothed loss falls fastest
against log(lr) (the slope on the log axis the curve is plotted on); ``lightning``, where it
falls fastest against lr itself (Lightning 2.6's ``suggestion()``: ``torch.gradient`` over lr,
the log slope divided by lr, which leans to smaller rates); and ``minimum/10``, the lr of the lowest
smoothed loss divided by ten, over the steps fastai's ``lr_find`` keeps for it (the first tenth and
the last five left out).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from attrs import define, field

from coretrain import Run, StepOutputs, hookimpl

SMOOTHING = 0.98
SKIP_START, SKIP_END = 10, 1
"""Steps left out at both ends when looking for the steepest descent (Lightning's defaults)."""
FASTAI_SKIP_END = 5
"""fastai's suggestions read ``recorder.losses[num_it // 10 : -5]``: the first tenth of the
planned steps and the last five left out."""


@define(kw_only=True)
class LRFinder:
    """Drives the learning rate of a short run and records its loss (registered by ``lr-find``)."""

    min_lr: float
    max_lr: float
    steps: int
    diverge: float = 4.0
    lrs: list[float] = field(factory=list)
    losses: list[float] = field(factory=list)
    smoothed: list[float] = field(factory=list)
    _base_lr: float = field(default=1.0, init=False)
    _average: float = field(default=0.0, init=False)

    def lr_at(self, step: int) -> float:
        """Lightning's sweep: step 1 at min_lr, step k > 1 at ``min_lr · (max_lr / min_lr) ** (k /
        steps)``, so step ``steps`` at max_lr. (Lightning's ``_ExponentialLR`` is stepped twice
        before the second batch, so its optimizer never trains at the ratio's first power; kept,
        so that the curve is Lightning's.)"""
        exponent = step / self.steps if step > 1 else 0.0
        return float(self.min_lr * (self.max_lr / self.min_lr) ** exponent)

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        self._base_lr = run.config.optimizer.lr or 1.0

    @hookimpl
    def pre_step(self, run: Run, step: int) -> None:
        """After the schedule set this update's rate: the test's rate, in each group's proportion
        to the configured lr (optimizer-overrides' lr_mult and max_lr)."""
        lr = self.lr_at(step)
        for group in run.optimizer.param_groups:
            share = group.get("max_lr", self._base_lr) / self._base_lr * group.get("lr_mult", 1.0)
            group["lr"] = lr * share
        self.lrs.append(lr)

    @hookimpl(tryfirst=True)
    def on_log(self, metrics: dict[str, float]) -> None:
        """The rate the test trained at, not the schedule's (which it overrides)."""
        if self.lrs:
            metrics["lr"] = self.lrs[-1]

    @hookimpl
    def post_step(self, run: Run, step: int, outputs: StepOutputs) -> None:
        loss = float(outputs.loss)  # host sync every step: a tuner's price, not a training run's
        self.losses.append(loss)
        self._average = SMOOTHING * self._average + (1 - SMOOTHING) * loss  # from 0, then bias-corrected
        self.smoothed.append(self._average / (1 - SMOOTHING ** (len(self.losses) + 1)))  # Lightning's off-by-one
        lowest = min(self.smoothed)
        if not math.isfinite(loss) or (len(self.losses) > 1 and self.smoothed[-1] > self.diverge * lowest):
            run.control.request_stop(f"lr-find: the loss diverged at lr {self.lrs[-1]:.3g}", checkpoint=False)
        elif step >= self.steps:
            run.control.request_stop("lr-find: the range is covered", checkpoint=False)

    def suggestions(self) -> dict[str, float]:
        """{"steepest": lr, "lightning": lr, "minimum/10": lr}, each present when the curve allows it."""
        points = [(lr, loss) for lr, loss in zip(self.lrs, self.smoothed) if math.isfinite(loss)]
        found: dict[str, float] = {}
        if not points:
            return found
        minimum = self.fastai_minimum()
        if minimum is not None:
            found["minimum/10"] = minimum / 10
        window = points[SKIP_START : len(points) - SKIP_END]
        if len(window) >= 3:
            slopes = [
                (window[i + 1][1] - window[i - 1][1]) / math.log(window[i + 1][0] / window[i - 1][0])
                for i in range(1, len(window) - 1)
            ]
            steepest = min(range(len(slopes)), key=slopes.__getitem__)
            found["steepest"] = window[steepest + 1][0]
        lightning = self.lightning()
        return found | ({"lightning": lightning} if lightning is not None else {})

    def fastai_minimum(self) -> float | None:
        """The lr of the lowest smoothed loss, as fastai's ``minimum`` finds it: over the steps it
        keeps (``[steps // 10 : -5]``), up to the first that is not finite. The first steps' smoothed
        losses are the lowest of many a curve that has not begun to fall yet (Lightning's bias
        correction halves the first); fastai's window leaves them out."""
        kept = list(zip(self.lrs, self.smoothed))[self.steps // 10 : -FASTAI_SKIP_END]
        best_lr, best_loss = None, math.inf
        for lr, loss in kept:
            if loss < best_loss:  # (NaN compares false: a diverged tail, where the average stays NaN, is passed over)
                best_lr, best_loss = lr, loss
        return best_lr

    def lightning(self) -> float | None:
        """Lightning's rule, as its ``_LRFinder.suggestion`` computes it: the ends skipped, the
        non-finite losses dropped, the lowest ``torch.gradient(loss, spacing=lr)``; its index
        counted from the first kept step, as Lightning counts it."""
        losses = torch.tensor(self.smoothed[SKIP_START:-SKIP_END])
        lrs = torch.tensor(self.lrs[SKIP_START:-SKIP_END])
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        if len(losses) < 2:
            return None
        return self.lrs[int(torch.argmin(torch.gradient(losses, spacing=[lrs])[0])) + SKIP_START]

    def rows(self) -> list[dict[str, Any]]:
        return [
            {"step": i + 1, "lr": lr, "loss": loss, "smoothed": smooth}
            for i, (lr, loss, smooth) in enumerate(zip(self.lrs, self.losses, self.smoothed))
        ]
