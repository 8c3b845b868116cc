"""Graceful exit on SIGTERM / SIGINT / SIGUSR1: the handler only records, the loop acts.

Checkpointing inside a signal handler is how runs lose data (it can interrupt a save, a
collective, a CUDA call). Here the handler stores the signal number; at the next step
boundary the ranks agree on it, ``on_signal`` runs, a checkpoint is saved and the process
exits with 128+signum.

The watcher is installed first thing in ``coretrain run``, before torch is imported, so a
signal during start-up is never lost (Python's default SIGINT handler raises
KeyboardInterrupt wherever the main thread is, and a finalizer or callback that swallows it
lets the run go on); start-up checks :meth:`SignalWatcher.check` between its phases.

A repeated SIGTERM or SIGUSR1 soon after the first changes nothing: schedulers signal every
process and torchrun forwards the signal again, so each worker may see it twice and must still
checkpoint. SIGINT while a signal is pending — a person pressing Ctrl-C again — aborts at once,
and so does any watched signal that comes :data:`REPEAT_AFTER_SECONDS` or more after a first
one the loop has not acted on: a hung process (a hook that never returns) ends on a scheduler's
or a person's second SIGTERM instead of waiting for SIGKILL.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any, Literal

DEFAULT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1")
REPEAT_AFTER_SECONDS = 5.0
"""A signal this long after a first one still pending is a second request, not a forwarded copy."""


class Interrupted(Exception):
    """A signal arrived during start-up: leave with 128+signum before training."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SignalWatcher:
    """Installs recording handlers for the run and restores the previous ones afterwards."""

    def __init__(self, names: Sequence[str] = DEFAULT_SIGNALS, impatient: Literal["kill", "raise"] = "kill") -> None:
        self.signums = [getattr(signal, name) for name in names]
        self.received: int | None = None
        self._received_at = 0.0
        self._previous: dict[int, Any] = {}
        self.impatient = impatient
        """A second Ctrl-C: "kill" the process as the default handler would (the CLI), or
        "raise" KeyboardInterrupt (the Python API: a notebook's kernel lives on)."""

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The handler: the first signal is only recorded (the loop agrees on it at a step's end). A
        Ctrl-C after it, or another signal ``REPEAT_AFTER_SECONDS`` later (the loop never got to
        the first), ends the process at once, as the default handler would (or raises
        KeyboardInterrupt, for the Python API)."""
        if self.received is None:
            self.received, self._received_at = signum, time.monotonic()
        elif signum == signal.SIGINT or time.monotonic() - self._received_at >= REPEAT_AFTER_SECONDS:
            self.uninstall()  # impatient Ctrl-C, or a second request the loop never got to: leave now
            if self.impatient == "raise" and signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)  # as the default would: the process ends by this signal
            os.kill(os.getpid(), signum)

    def install(self) -> SignalWatcher:
        """Handle the watched signals from now on, keeping the previous handlers to put back."""
        for signum in self.signums:
            if signum not in self._previous:  # after the run, a Ctrl-C is no longer one "during start-up"
                old = signal.signal(signum, self._handle)
                self._previous[signum] = signal.default_int_handler if getattr(old, "coretrain_start_up", 0) else old
        return self

    def keep_only(self, names: Sequence[str]) -> None:
        """Narrow the watched signals to the config's ``train.exit_signals`` (after start-up)."""
        wanted = {getattr(signal, name) for name in names}
        for signum in [s for s in self._previous if s not in wanted]:
            signal.signal(signum, self._previous.pop(signum))
        self.signums = [s for s in self.signums if s in wanted]

    def check(self) -> None:
        """Raise :class:`Interrupted` if a signal arrived (called between start-up phases)."""
        if self.received is not None:
            raise Interrupted(self.received)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> SignalWatcher:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
