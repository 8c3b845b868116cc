"""``stragglers``: find ranks that slow the job down (Megatron's straggler detector).

Each rank times its steps (from the start of ``pre_step`` to ``post_step``). Every
``report_interval`` seconds — checked at log intervals, agreed across ranks — the mean and
best step times are gathered on every rank and scored in [0, 1]:

- relative score = fastest rank's mean / this rank's mean (1 = as fast as the fastest);
- individual score = this rank's best interval mean so far in this job / its mean now
  (1 = as fast as it has been; the first report is always 1). Comparing interval means, as
  nvidia-resiliency-ext does, keeps one slow step (a GC pause, a noisy neighbour) from
  flagging a healthy rank, which a best-single-step / mean ratio does on a busy host.

Ranks under a threshold (0.7 by default) are stragglers; rank 0 prints the best and worst N,
the scores join the logged metrics (``stragglers/...``), and ``stop_if_detected`` asks the
loop to checkpoint and stop — on every rank, since every rank scores the same gathered data.

Measured on the host clock: under DDP the gradient all-reduce makes fast ranks wait for the
slow one inside backward, so relative scores flatten; the individual score still shows a
rank that got slower than itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from attrs import define, field

from coretrain import Run, hookimpl, in_range, non_negative, positive


@define(kw_only=True)
class Stragglers:
    """Score each rank's step time against the fastest rank and its own best."""

    report_interval: float = field(default=300.0, validator=non_negative)
    """Seconds between reports (checked at log intervals); 0 = every log interval."""
    relative_threshold: float = field(default=0.7, validator=in_range(0, 1))
    """A rank slower than this share of the fastest rank's speed is a straggler."""
    individual_threshold: float = field(default=0.7, validator=in_range(0, 1))
    """A rank slower than this share of its own best speed is a straggler."""
    report_count: int = field(default=5, validator=positive)
    """How many best and worst ranks to print."""
    stop_if_detected: bool = False
    """Checkpoint and stop the run when a straggler is found."""
    warmup_steps: int = field(default=5, validator=non_negative)
    """Steps not timed after start or resume (allocator, caches and compilation settle)."""
    last_report: dict[str, Any] = field(factory=dict, init=False)
    _started: float = field(default=0.0, init=False, repr=False)
    _total: float = field(default=0.0, init=False, repr=False)
    _count: int = field(default=0, init=False, repr=False)
    _best_mean: float = field(default=float("inf"), init=False, repr=False)
    _reported_at: float = field(default=0.0, init=False, repr=False)
    _first_timed: int = field(default=0, init=False, repr=False)

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        self._reported_at = time.monotonic()
        self._first_timed = run.state.step + self.warmup_steps + 1

    @hookimpl(tryfirst=True)
    def pre_step(self) -> None:
        self._started = time.perf_counter()

    @hookimpl(trylast=True)
    def post_step(self, step: int) -> None:
        if step < self._first_timed:
            return
        elapsed = time.perf_counter() - self._started
        self._total += elapsed
        self._count += 1

    @hookimpl(tryfirst=True)  # before the backends, so the scores are logged with the step
    def on_log(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        import torch

        from coretrain import max_over_ranks

        due = time.monotonic() - self._reported_at >= self.report_interval and self._count > 0
        if not max_over_ranks(int(due))[0]:
            return
        mean = self._total / max(self._count, 1)
        self._best_mean = min(self._best_mean, mean)
        local = torch.tensor([mean, self._best_mean], dtype=torch.float64)
        if run.dist.world_size > 1:
            gathered = [torch.zeros_like(local) for _ in range(run.dist.world_size)]
            torch.distributed.all_gather(gathered, local)
        else:
            gathered = [local]
        means = [float(t[0]) for t in gathered]
        best_means = [float(t[1]) for t in gathered]
        fastest = min(means)
        relative = [fastest / m if m > 0 else 1.0 for m in means]
        individual = [b / m if m > 0 else 1.0 for b, m in zip(best_means, means)]
        slow = [
            r
            for r in range(len(means))
            if relative[r] < self.relative_threshold or individual[r] < self.individual_threshold
        ]
        self.last_report = {"step": step, "relative": relative, "individual": individual, "stragglers": slow}
        metrics["stragglers/min_relative_score"] = min(relative)
        metrics["stragglers/min_individual_score"] = min(individual)
        metrics["stragglers/count"] = float(len(slow))
        if run.dist.is_main:
            order = sorted(range(len(means)), key=lambda r: relative[r])
            rows: Callable[[list[int]], str] = lambda ranks: ", ".join(  # noqa: E731
                f"rank {r}: {means[r] * 1e3:.1f} ms/step (relative {relative[r]:.2f}, individual {individual[r]:.2f})"
                for r in ranks
            )
            n = self.report_count
            print(f"stragglers at step {step}: worst {rows(order[:n])}; best {rows(order[::-1][:n])}", flush=True)
            if slow:
                print(
                    f"stragglers at step {step}: ranks {slow} below thresholds "
                    f"(relative {self.relative_threshold}, individual {self.individual_threshold})",
                    flush=True,
                )
        if slow and self.stop_if_detected:
            run.control.request_stop(f"stragglers: ranks {slow} are slow")
        self._total, self._count = 0.0, 0
        self._reported_at = time.monotonic()
