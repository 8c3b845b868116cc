"""When training stops, agreed across ranks so every rank stops after the same step.

What only one rank may see — a signal, a plugin's stop or checkpoint request, its clock
passing ``exit_duration_in_mins`` — is agreed one step late through a non-blocking
all-reduce, so a plain step waits on no collective (at once on a save, evaluation or the last
step, which wait on the ranks anyway: a stop or save asked for from an evaluation's result
happens at that step on every rank, as on one);
what every rank computes alike (``exit_interval``) acts at once. The reasons are named
(:class:`Stop`); the largest over ranks wins.
"""

from __future__ import annotations

import enum
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from coretrain.dist import OneStepLate, max_over_ranks
from coretrain.hookspecs import Outcome
from coretrain.run import Run
from coretrain.signals import SignalWatcher

log = logging.getLogger("coretrain")


class Stop(enum.IntEnum):
    """Why training stops, as agreed across ranks: the largest value over ranks wins, so a
    signal outranks a plugin's stop, which outranks the deadline and exit_interval."""

    NONE = 0
    EXIT_INTERVAL = 1
    EXIT_DURATION = 2
    PLUGIN = 3
    SIGNAL = 4


OUTCOMES: tuple[Outcome | None, ...] = (None, "exit_interval", "exit_duration", "stopped", "signal")
"""What on_train_end is told for each :class:`Stop`, by its value."""


class StopAgreement:
    """Asked after every step whether training stops (and on a signal, tells on_signal)."""

    def __init__(
        self, run: Run, signals: SignalWatcher, on_signal: Callable[..., Any] | None, mark: Callable[[int, str], None]
    ) -> None:
        self.run, self.signals, self.on_signal, self.mark = run, signals, on_signal, mark
        self.signum: int | None = None
        """The agreed signal that stopped the run (its exit code is 128 + signum)."""
        self.agreement = OneStepLate(4)
        """Stop reason, signal, exit code, checkpoint request: proposed each step, agreed the next."""
        self.deadline: float | None = None
        self.check_every_step = False

    def start(self) -> None:
        """Training starts now: the deadline counts from here."""
        cfg, world = self.run.config.train, self.run.dist.world_size
        # each rank's own deadline; agreeing on the largest Stop makes the earliest-started rank's
        # deadline count for all, i.e. the start time is the minimum over ranks
        self.deadline = time.monotonic() + cfg.exit_duration_in_mins * 60 if cfg.exit_duration_in_mins else None
        self.check_every_step = self.deadline is not None or cfg.exit_interval is not None or world > 1

    def finish(self) -> None:
        """Wait for the proposal in flight (before the ranks' next collectives or shutdown)."""
        self.agreement.finish()

    def before_first_step(self) -> Outcome | None:
        """A signal that arrived while the run was being built and restored, or a stop a plugin
        asked for on resume (a run that had early-stopped): stop before step one, agreed across
        ranks (nothing new to save)."""
        control = self.run.control
        signum, stop = self.signals.received or 0, int(control.stop_reason is not None)
        if self.run.dist.world_size > 1:
            signum, stop, control.exit_code = max_over_ranks(signum, stop, control.exit_code)
        if signum:
            self.signum = signum
            log.info("stopping before the first step: received %s", signal.Signals(signum).name)
            return "signal"
        if stop:
            log.info("stopping before the first step: %s", control.stop_reason or "another rank requested a stop")
            return "stopped"
        return None

    def after(self, step: int) -> Outcome | None:
        """Why training stops after this step, agreed across ranks (then on_signal); None = go on."""
        run = self.run
        if not (self.check_every_step or run.control.stop_reason is not None or self.signals.received is not None):
            return None
        reason = self._reason(step)
        if reason == "signal" and self.on_signal and self.signum is not None:
            self.on_signal(run=run, signum=self.signum)
        return reason

    def _reason(self, step: int) -> Outcome | None:
        """Exit conditions, agreed across ranks so every rank stops at the same step.

        What only one rank may see (a signal, a plugin's stop or checkpoint request, its clock
        passing the deadline) is agreed one step late through a non-blocking all-reduce, so a
        plain step waits on no collective; what every rank computes alike (exit_interval) acts
        at once."""
        control = self.run.control
        stop, signum = Stop.NONE, self.signals.received or 0
        if signum:
            stop = Stop.SIGNAL
        elif control.stop_reason is not None:
            stop = Stop.PLUGIN
        elif self.deadline is not None and time.monotonic() >= self.deadline:
            stop = Stop.EXIT_DURATION
        if self.run.dist.world_size > 1:  # one reason, and a checkpoint if any rank asks for one
            cadence = self.run.cadence
            deciding = step == self.run.train_iters or cadence.saves(step) or cadence.evaluates(step)
            self.mark(step, "agreement")  # waiting for the other ranks from here
            wants = int(control.checkpoint_requested) * (2 if control.checkpoint_persistent else 1)  # persistent wins
            agreed, signum, control.exit_code, wants = self.agreement.exchange(
                stop, signum, control.exit_code, wants, now=deciding
            )
            stop = Stop(agreed)
            control.checkpoint_requested, control.checkpoint_persistent = wants > 0, wants == 2
        if stop is Stop.NONE and self.run.cadence.exits(step):
            stop = Stop.EXIT_INTERVAL
        if stop is Stop.SIGNAL:
            self.signum = signum
            control.request_stop(f"received {signal.Signals(signum).name}")
        elif stop is Stop.PLUGIN and control.stop_reason is None:  # the agreed request says whether to save
            persistent = control.checkpoint_requested and control.checkpoint_persistent
            control.request_stop("another rank requested a stop", checkpoint=persistent)
        return OUTCOMES[stop]
