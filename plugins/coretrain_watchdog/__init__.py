"""``watchdog`` (on by default): a rank that makes no progress is named, and the job ends.

A collective timeout alone names the wrong rank: the ranks waiting in an all-reduce time out
and report themselves, while the rank that hung — in a plugin's hook, a data worker, a
deadlock — says nothing; and a single process that hangs just hangs. Here the loop's phase
marks (hook ``phase_listener``; each mark is two attribute writes) tell a daemon thread in
every process, one rank or many, where the loop is: after
``step_timeout_seconds`` without one (``init_timeout_seconds`` before the first
step completes, and during evaluation and checkpoints, which may take long) it prints
``rank 1: no progress for 60 s at step 412, last in pre_step (plugin 'x', in its pre_step), at
FILE:LINE in FUNCTION`` and ends the process, so the launcher takes the job down. A rank
waiting in a collective for a hung peer says so too (``last in agreement``): the line whose
phase is not a collective names the culprit. A rank that cannot speak for itself — stopped
(SIGSTOP), stuck in a call holding the interpreter — is named by the rank waiting for it, from
the heartbeats every rank writes into the rendezvous store (:mod:`.heartbeat`). The verdict
also goes into torchrun's error file, so the launcher's last line names the culprit. And a rank
whose launcher dies (torchrun killed alone) is sent SIGTERM: it stops as on any SIGTERM, agreed
and checkpointed, instead of training on without it. Turn it off with
``[plugins.watchdog] enabled = false``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from attrs import define, field

from coretrain import Outcome, Run, hookimpl, positive
from coretrain_watchdog.heartbeat import Heartbeat

log = logging.getLogger("coretrain")

HANG_EXIT_CODE = 124
"""The process's exit code when the watchdog ends it (timeout(1)'s)."""
LONG_PHASES = frozenset({"restore", "eval", "checkpoint", "end"})
"""Phases that may take long by design: judged by the long (start-up) timeout."""
WAITING_PHASES = frozenset({"forward_backward", "update", "log", "agreement"})
"""Phases that wait in collectives for the other ranks: given a grace period, so that the rank
that really hung (in a local phase) reports first and names itself."""


def stop_with_the_launcher() -> None:
    """A rank torchrun started gets SIGTERM when its launcher dies (Linux): killed alone, the
    launcher would leave its ranks training, and the other machines' ranks waiting on them.
    SIGTERM is the graceful stop: every rank agrees, checkpoints and exits. A launcher that set
    its own signal keeps it (coretrain's across machines: SIGKILL, the other machines go on)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig, pr_get_pdeathsig = 1, 2
    libc, chosen = ctypes.CDLL(None, use_errno=True), ctypes.c_int(0)
    libc.prctl(pr_get_pdeathsig, ctypes.byref(chosen))
    if chosen.value:
        return
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() == 1:  # the launcher died before we asked
        os.kill(os.getpid(), signal.SIGTERM)


@define(kw_only=True)
class Watchdog:
    """Ends a rank that makes no progress for step_timeout_seconds, naming where it hung."""

    step_timeout_seconds: float = field(default=300.0, validator=positive)
    """After the first step: a rank stuck this long in one step is named and the job ends (before
    it, and in evaluation and checkpoints: distributed.init_timeout_seconds). Was
    distributed.step_timeout_seconds."""
    _watch: HangWatch | None = field(default=None, init=False, repr=False)

    @hookimpl
    def configure_run(self) -> None:
        stop_with_the_launcher()

    @hookimpl
    def phase_listener(self, run: Run) -> Callable[[int, str], None]:
        timeouts = run.config.distributed
        self._watch = HangWatch(
            run.dist.rank,
            timeouts.init_timeout_seconds,
            self.step_timeout_seconds,
            Path(run.output_dir),
            run.plugins.running,
        )
        self._watch.heartbeat = Heartbeat.of_this_job(
            run.dist.rank, max(1.0, min(10.0, self.step_timeout_seconds / 10)), self._watch.mark
        )
        return self._watch.start().beat

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        if self._watch is not None:
            self._watch.first_step = run.state.step + 1

    @hookimpl(tryfirst=True)
    def on_train_end(self, run: Run, outcome: Outcome) -> None:
        if self._watch is not None:
            self._watch.stop()


class HangWatch:
    """Ends this process when the loop's marks stop changing; one per rank."""

    def __init__(
        self,
        rank: int,
        init_timeout: float,
        step_timeout: float,
        output_dir: Path | None = None,
        running: Sequence[tuple[str, str]] = (),
    ) -> None:
        self.rank, self.init_timeout, self.step_timeout = rank, init_timeout, step_timeout
        self.output_dir, self.running = output_dir, running
        self._main = threading.main_thread().ident
        self.step, self.phase = 0, "built"
        """Until the loop's first mark nothing is judged (a Trainer built and never run)."""
        self.first_step: int | None = None
        """The first step this run trains (set once restored): judged by the long timeout."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="coretrain-watchdog", daemon=True)
        self.heartbeat: Heartbeat | None = None
        """This rank's pulse in the store, and its peers' (a rank of a torchrun job)."""

    def start(self) -> HangWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self.heartbeat is not None:
            self.heartbeat.stop()

    def mark(self) -> tuple[int, str]:
        """Where the loop is: (step, phase)."""
        return self.step, self.phase

    def beat(self, step: int, phase: str) -> None:
        """The loop is at ``phase`` of ``step`` now: two attribute writes, no clock read (the
        watching thread notes when the mark last changed); at a new step, the heartbeat is told."""
        new_step = step != self.step
        self.step, self.phase = step, phase
        if new_step and self.heartbeat is not None:
            self.heartbeat.new_step()

    @property
    def warmed_up(self) -> bool:
        """A step after the first one watched has begun: the first (compiling, filling caches)
        is judged by the long timeout."""
        return self.first_step is not None and self.step > self.first_step

    def _timeout(self) -> float:
        timeout = self.init_timeout if not self.warmed_up or self.phase in LONG_PHASES else self.step_timeout
        return timeout + (max(5.0, timeout / 4) if self.phase in WAITING_PHASES else 0.0)

    def _watch(self) -> None:
        seen, since = (self.step, self.phase), time.monotonic()
        while not self._stop.wait(min(1.0, self.step_timeout / 10)):
            now = (self.step, self.phase)
            if now[1] == "built":
                continue
            if now[1] == "end":
                return
            if now != seen:
                seen, since = now, time.monotonic()
                if self.heartbeat is not None:
                    self.heartbeat.peers_wanted = False  # moving again: no need to read the others
                continue
            idle, timeout = time.monotonic() - since, self._timeout()
            if self.heartbeat is not None and idle > min(timeout, self.step_timeout) / 4:
                self.heartbeat.watch_peers()  # stuck a while: is it waiting for a rank whose pulse stopped?
            culprit = self._culprit(idle)
            if culprit is not None or idle > timeout:
                self._report(culprit or self._own_hang(idle))
                os._exit(HANG_EXIT_CODE)  # the loop is stuck: no clean way out of it

    def _own_hang(self, idle: float) -> str:
        line = f"rank {self.rank}: no progress for {idle:.0f} s at step {self.step}, last in {self.phase}"
        if self.running:
            plugin, hook = self.running[-1]
            line += f" (plugin '{plugin}', in its {hook})"
        return line + self._where()

    def _culprit(self, idle: float) -> str | None:
        """The rank that cannot speak for itself: its heartbeat (or the store's answers) stopped
        for ``step_timeout_seconds`` while this rank made no progress (None: every pulse goes on)."""
        heartbeat, cause = self.heartbeat, "stopped (SIGSTOP?), or stuck in a call that holds the interpreter"
        if heartbeat is None or not heartbeat.peers_wanted:
            return None
        waited = f"rank {self.rank} waited {idle:.0f} s for it at step {self.step}, in {self.phase}"
        if heartbeat.store_silent_for() > self.step_timeout:
            return (
                f"{heartbeat.store_host} is not responding: the rendezvous store it holds has not answered for "
                f"{heartbeat.store_silent_for():.0f} s — {cause}; {waited}"
            )
        silent = [peer for peer in heartbeat.silent_peers() if peer.seconds > self.step_timeout]
        if not silent:
            return None
        names = ", ".join(f"rank {p.rank} (no heartbeat for {p.seconds:.0f} s, last at {p.where})" for p in silent)
        return f"{names} {'is' if len(silent) == 1 else 'are'} not responding — {cause}; {waited}"

    def _report(self, line: str) -> None:
        print(f"error: {line}; ending rank {self.rank} (exit {HANG_EXIT_CODE})", file=sys.stderr, flush=True)
        record_for_the_launcher(line)
        if self.output_dir is not None:
            try:
                with open(self.output_dir / f"hang.rank{self.rank}.log", "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            except OSError:
                pass

    def _where(self) -> str:
        """Where the training thread is now: its innermost frame, for the report."""
        frame = sys._current_frames().get(self._main) if self._main is not None else None
        if frame is None:
            return ""
        return f", at {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"


def record_for_the_launcher(line: str) -> None:
    """The verdict in torchrun's error file for this rank (``TORCHELASTIC_ERROR_FILE``, in the
    format torch's ErrorHandler writes), which the launcher reports as the job's root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass
