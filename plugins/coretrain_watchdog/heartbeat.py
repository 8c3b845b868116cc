"""Each rank's pulse in the rendezvous store, so the others can name a rank that froze.

A rank stopped with SIGSTOP, or stuck in a call that holds the interpreter, runs no thread at
all: its own watchdog cannot speak, and its peers, waiting for it in a collective, would name
themselves. So every rank's :class:`Heartbeat` thread writes a counter (with the loop's step and
phase) under its rank into the store the process group met through, every ``period`` seconds
and as each step begins (so a rank that froze is named with the step it froze in);
a rank that has waited long in a collective reads the others' (:meth:`Heartbeat.watch_peers`)
and names the ones whose counter stood still. The store lives in a process of the job (rank 0's
under coretrain's launcher, the launcher's under plain torchrun): when it stops answering, that
process is the one that froze, and it is named instead.

Store calls run on this thread only — a call to a store whose host froze does not return — so
the watchdog reads only what this thread has seen, never waits on it.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from attrs import frozen

HANDOFF_SECONDS = 0.2
"""The longest a new step waits for its pulse to reach the store (a slow or gone store does not
hold training up longer)."""


@frozen
class Silent:
    """A peer whose heartbeat stopped: for how long, and where its loop was last."""

    rank: int
    seconds: float
    where: str


class Heartbeat:
    """Writes this rank's pulse; on demand, reads the others' and notes when each last changed."""

    def __init__(self, rank: int, world: int, period: float, mark: Callable[[], tuple[int, str]]) -> None:
        self.rank, self.world, self.period, self.mark = rank, world, period, mark
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"coretrain/heartbeat/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/{restart}/"
        self.store_host = (
            "the launcher's process" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
        )
        self.answered = time.monotonic()
        """When the store last answered this thread (its host froze when this stands still)."""
        self.peers_wanted = False
        self._peers: dict[int, tuple[str, float]] = {}
        self._watched_since = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set when the loop begins a step: its pulse is written at once, not up to a period late."""
        self._sent = threading.Event()
        """Set once a pulse has gone to the store (what :meth:`new_step` waits for)."""
        self._store: Any = None
        self._thread = threading.Thread(target=self._run, name="coretrain-heartbeat", daemon=True)

    @classmethod
    def of_this_job(cls, rank: int, period: float, mark: Callable[[], tuple[int, str]]) -> Heartbeat | None:
        """The heartbeat of a rank torchrun started (None for a single process: no peers)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world < 2 or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
            return None
        return cls(rank, world, period, mark).start()

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def new_step(self) -> None:
        """The loop began a step: the pulse is written before the step runs (waiting at most
        ``HANDOFF_SECONDS`` for the store), so a rank that freezes in it is last heard in it. A
        round trip to the store per step: nothing beside a real step's seconds."""
        if self._thread.is_alive():
            self._sent.clear()
            self._wake.set()
            self._sent.wait(HANDOFF_SECONDS)

    def watch_peers(self) -> None:
        """From now on, read the other ranks' heartbeats too (this rank waits for someone)."""
        if not self.peers_wanted:
            self._watched_since, self._peers, self.peers_wanted = time.monotonic(), {}, True

    def silent_peers(self) -> list[Silent]:
        """The ranks whose heartbeat has not changed since this rank began to watch, for at
        least three periods (a live rank beats every period)."""
        now = time.monotonic()
        if now - self._watched_since < 3 * self.period:
            return []
        return [
            Silent(rank, now - since, value.split(" ", 1)[1] if " " in value else "before its first step")
            for rank, (value, since) in sorted(self._peers.items())
            if rank != self.rank and now - since >= 3 * self.period
        ]

    def store_silent_for(self) -> float:
        """Seconds since the store last answered this thread."""
        return time.monotonic() - self.answered

    def _run(self) -> None:
        import torch.distributed as dist

        try:
            client = dist.TCPStore  # type: ignore[attr-defined]  # torch exports it untyped
            self._store = client(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=max(30.0, 3 * self.period)),
            )
        except Exception:  # no store to beat into: the watchdog still judges this rank alone
            return
        beats = 0
        while not self._stop.is_set():
            beats += 1
            self._wake.clear()  # before reading the mark: a step begun after this wakes the next round
            step, phase = self.mark()
            try:
                self._store.set(f"{self.prefix}{self.rank}", f"{beats} step {step}, {phase}")
                self._sent.set()
                if self.peers_wanted:
                    self._read_peers()
            except Exception:  # the store's host is gone or going: the watchdog reads the silence
                pass
            else:
                self.answered = time.monotonic()
            self._wake.wait(self.period)

    def _read_peers(self) -> None:
        now = time.monotonic()
        for rank in range(self.world):
            key = f"{self.prefix}{rank}"
            value = self._store.get(key).decode() if self._store.check([key]) else "0"
            seen = self._peers.get(rank)
            if seen is None or seen[0] != value:
                self._peers[rank] = (value, now)
