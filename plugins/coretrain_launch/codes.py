"""How a rank's exit code reads to its launcher: torchrun's and coretrain's own alike."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""Signals a rank answers by agreeing with the others, saving a checkpoint and stopping."""

STOP_CODES = {128 + int(number): number.name for number in STOP_SIGNALS}
"""A rank's exit code after such a stop, with its checkpoint saved: not a failure."""

USAGE_EXIT_CODE = 2
"""A rank's exit code after a user mistake, which it has printed as one ``error:`` line."""

HANG_EXIT_CODE = 124
"""The watchdog's exit: a rank made no progress — itself, or a peer it names as frozen."""
