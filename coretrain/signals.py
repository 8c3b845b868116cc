"""Graceful exit on SIGTERM / SIGINT / SIGUSR1: the handler only records, the loop acts.

Checkpointing inside a signal handler is how runs lose data (it can interrupt a save, a
collective, a CUDA call). Here the handler stores the signal number; at the next step
boundary the ranks agree on it, ``on_signal`` runs, a checkpoint is saved and the process
exits with 128+signum. A second signal while the first is pending aborts at once.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from types import FrameType
from typing import Any


class SignalWatcher:
    """Installs recording handlers for the run and restores the previous ones afterwards."""

    def __init__(self, names: Sequence[str]) -> None:
        self.signums = [getattr(signal, name) for name in names]
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # impatient second signal: leave now, as the default would
            self.uninstall()
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum

    def install(self) -> None:
        for signum in self.signums:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def __enter__(self) -> SignalWatcher:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()
