"""``inprocess-restart``: a failure costs seconds, not a job restart (Megatron's in-process restart).

    [plugins.inprocess-restart]
    max_restarts = 3                 # then the failure ends the job, as without the plugin
    restart_timeout_seconds = 60     # how long the ranks wait for each other to re-form
    stuck_seconds = 10               # a rank still in the failed run this long after the others
                                     # began the restart ends its process: the launcher restarts the job

When a rank raises — a failing step, a plugin's error, a collective whose peer left; not a
:class:`coretrain.UserError`, a mistake a restart would make again — every rank
leaves the run (a peer of the failing rank fails at its next collective: gloo and NCCL report the
broken connection), the process group is left and formed again through the launcher's
rendezvous store (torchrun's, on ``MASTER_ADDR:MASTER_PORT``, under a key prefix of its own for
each restart), and the core builds the run again in the same process — no new process, no
re-import — and resumes it from the newest checkpoint (with ``[plugins.local-checkpoint]``, one
in host memory from the step before the failure). The ranks that raised leave their cause in
the store, so every rank's log line names it: ``in-process restart 1/3 after rank 1 raised at
step 8: RuntimeError: ...``, then ``resumed at step 5 in 0.4 s``; ``inprocess_restarts`` joins
the logged metrics. Losses after a restart are an uninterrupted run's (the resume is exact).

A process that dies (SIGKILL, the OOM killer) cannot restart itself. Under torchrun its
launcher restarts the job (``--max-restarts``); under ``coretrain run --nproc-per-node N
--replace-failed-ranks --max-restarts K`` the launcher starts a new process in its place
alone, and that process joins the group the surviving ranks re-form (they wait for it in-process,
up to ``restart_timeout_seconds``): ``in-process restart 1/3 after rank 1 died (SIGKILL); a new
process took its place``.

Across machines (``coretrain run --nnodes MIN:MAX --rdzv-endpoint HOST:PORT
--replace-failed-ranks``) a machine that joins is taken in the same way: the ranks see the
launcher add its ranks, stop together at the next step with a checkpoint and form the next group
with them (``in-process re-form: 2 rank(s) joined; 4 ranks go on (was 2)``); the new ranks
load that checkpoint. A machine that leaves is a failure its peers see, and the launcher drops
its ranks while they wait.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist
from attrs import define, field

from coretrain import Outcome, Run, StepOutputs, UserError, hookimpl, max_over_ranks, non_negative, positive
from coretrain_inprocess_restart.causes import PEER_FAILURE, described
from coretrain_inprocess_restart.groups import abort_nccl, cut, tcp_connections
from coretrain_inprocess_restart.members import (
    CHANGES_KEY,
    JOINED_ENV,
    READY_KEY,
    SLOT,
    await_members,
    await_taken_in,
    changes,
    chosen,
    name_members,
)
from coretrain_inprocess_restart.stuck import StuckGuard

log = logging.getLogger("coretrain")

_generation = 0
"""Process groups this process formed after a failure: each on a store prefix of its own (every
rank of a job restarts alike, so their counts agree), also across runs in one process."""

REPLACED_ENV = "CORETRAIN_REPLACED"
"""Set by coretrain's launcher (``--replace-failed-ranks``) for a process that replaces one that
died: when (Unix time) and how its predecessor ended ("1764000000.0 SIGKILL")."""


class MembershipChange(Exception):
    """Raised together by every rank, after a stop as agreed, to take ranks that wait to join in."""


def _attempt_keys() -> str:
    return f"coretrain/inprocess-restart/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _say(message: str, *args: object) -> None:
    """The job's one line, rank 0's (the others' in their own logs)."""
    (log.warning if os.environ.get("RANK", "0") == "0" else log.debug)(message, *args)


def restart_prefix(generation: int) -> str:
    """The store keys of one restart of this attempt of the job."""
    return f"{_attempt_keys()}/{generation}"


@define(kw_only=True)
class InProcessRestart:
    """After a failure, re-form the process group and resume from the newest checkpoint in-process."""

    max_restarts: int = field(default=3, validator=non_negative)
    """Restarts this process may make; the next failure ends the job."""
    restart_timeout_seconds: float = field(default=60.0, validator=positive)
    """How long the ranks wait for each other to form the next process group."""
    stuck_seconds: float = field(default=10.0, validator=positive)
    """How long a rank may stay in the failed run after the others began the restart (blocked
    where their failure does not reach it); then it ends its process so the launcher restarts the job."""
    _guard: StuckGuard | None = field(default=None, init=False)
    _restarts: int = field(default=0, init=False)
    _backend: str | None = field(default=None, init=False)
    _timeout: float = field(default=600.0, init=False)
    _since: float | None = field(default=None, init=False)
    _store: Any = field(default=None, init=False)
    _first_store: Any = field(default=None, init=False)
    _connections: dict[int, int] = field(factory=dict, init=False)
    """gloo's connections to the peers (fd -> socket inode), to shut down when leaving."""
    _what: str = field(default="in-process restart", init=False)
    """The last restart, as the resumed line names it."""
    _asked: float = field(default=0.0, init=False)
    _changes: int | None = field(default=None, init=False)
    """The launcher's count of ranks added to join, as of this group (None: not across machines)."""

    @hookimpl
    def configure_run(self, run: Run) -> None:
        """How the run's process group was formed, to form the next one alike; its store, kept:
        the launcher's (torchrun's agent's, coretrain's), or the one rank 0 serves (under
        torchrun with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``), which would go with the group otherwise."""
        grouped = dist.is_available() and dist.is_initialized()
        self._backend = dist.get_backend() if grouped else self._backend
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # (also for one rank)
        if self._store is None and (grouped and int(os.environ.get("WORLD_SIZE", "1")) > 1 or agent_store):
            if grouped:
                self._first_store = dist.distributed_c10d._get_default_store()  # (rank 0's may serve it)
            self._store = self._launcher_store()  # its keys as a replacement's, not under the group's name
        if self._changes is None and self._store is not None and self._store.check([CHANGES_KEY]):
            self._changes = changes(self._store)  # (the launcher across machines keeps the count)
        self._timeout = run.config.distributed.init_timeout_seconds

    @hookimpl
    def join_process_group(self) -> None:
        """A process that replaces one that died joins the group its surviving peers re-form
        (the restart after the one they were in), not a first group of its own."""
        replaced = os.environ.get(REPLACED_ENV)
        if self._store is None and JOINED_ENV in os.environ:
            self._join_running_job()
        if replaced is None or self._store is not None or int(os.environ.get("WORLD_SIZE", "1")) == 1:
            return
        at, _, how = replaced.partition(" ")
        self._since = time.monotonic() - max(0.0, time.time() - float(at))  # from the death, as the survivors'
        self._store = self._launcher_store()
        latest = f"{_attempt_keys()}/latest"
        global _generation
        if self._store.check([latest]):  # the restart the survivors are in: the next one is ours too
            _generation, self._restarts = (int(n) for n in self._store.get(latest).decode().split())
        self._restarts += 1
        self._said_restart(self._form_group(f"died ({how}); a new process took its place", own=True))

    def _join_running_job(self) -> None:
        """A machine's rank that joins: wait for the ranks to stop and name it among the members of
        their next group, then form it with them."""
        self._since = time.monotonic() - max(0.0, time.time() - float(os.environ[JOINED_ENV]))
        store = self._store = self._launcher_store()
        store.add(READY_KEY, 1)  # the launcher now has the running ranks stop and take this one in
        global _generation
        latest = f"{_attempt_keys()}/latest"
        _generation, self._restarts = await_taken_in(store, latest, restart_prefix, self.restart_timeout_seconds)
        self._said_reformed(self._form_group("joined", planned=True))

    def _launcher_store(self) -> Any:
        """The launcher's store, with the keys a first group's ``env://`` store has (torch's prefix)."""
        wait = datetime.timedelta(seconds=self.restart_timeout_seconds)
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(address, port, int(os.environ["WORLD_SIZE"]), False, timeout=wait)  # type: ignore[attr-defined]
        return dist.PrefixStore("default_pg", store)  # type: ignore[attr-defined]

    @hookimpl(tryfirst=True)
    def on_train_end(self, outcome: Outcome) -> None:
        """A failing run leaves its process group now, before another plugin's end waits on a
        peer (a collective there would wait for a rank still blocked in the step: on 4 ranks it
        did, until the watchdog ended the job)."""
        if self._guard is not None:
            self._guard.step = None
        if outcome == "error" and self._restarts < self.max_restarts:
            self._since = time.monotonic()  # the run failed now: a restart's seconds count from here
            self._leave_group()
        if outcome == "stopped" and self._changes is not None:
            self._take_joining_in()

    @hookimpl
    def post_step(self, run: Run, step: int, outputs: StepOutputs) -> None:
        """Ranks wait to join (the launcher counted them): stop together, with a checkpoint they load.
        The store is asked at most once a second, not at every step."""
        if self._changes is None or run.control.stop_reason is not None or time.monotonic() < self._asked + 1:
            return
        self._asked = time.monotonic()
        if changes(self._store) > self._changes:
            run.control.request_stop("ranks wait to join: stopping with a checkpoint to take them in")

    def _take_joining_in(self) -> None:
        """After the stop (agreed, the group still up), if any rank saw ranks waiting: rank 0 names
        the next group's members, and every rank raises to form it in-process."""
        (waiting,) = max_over_ranks(int(changes(self._store) > (self._changes or 0)))
        if not waiting:
            return
        if not dist.is_initialized() or dist.get_rank() == 0:
            name_members(self._store, f"{restart_prefix(_generation + 1)}/members")
        self._since = time.monotonic()
        raise MembershipChange("ranks wait to join")

    def _leave_group(self) -> None:
        """(The core's shutdown that follows keeps the groups from being destroyed.)"""
        if self._backend == "nccl":
            abort_nccl()
        cut(self._connections or self._gloo_connections())  # failed before training: what there is now
        self._connections = {}

    @hookimpl
    def restart_in_process(self, run: Run | None, error: BaseException) -> bool | None:
        if self._guard is not None:
            self._guard.step = None  # this rank follows its peers (or ends the job)
        if isinstance(error, UserError):  # a mistake to fix: a restart would make it again
            return None
        if isinstance(getattr(error, "cause", None), MembershipChange):  # planned: not a failure
            self._leave_group()
            self._said_reformed(self._form_group("stopped to take ranks in", planned=True))
            return True
        if self._restarts >= self.max_restarts:
            log.error(
                "inprocess-restart: %d restart(s) made, the most allowed: this failure ends the job", self._restarts
            )
            return None
        self._leave_group()  # (when building the run failed, on_train_end was not called)
        self._restarts += 1
        self._since = self._since or time.monotonic()
        cause = f"this rank {described(run, error)}"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            cause = self._form_group(described(run, error))
        self._said_restart(cause)
        return True

    def _form_group(self, failure: str, own: bool = False, planned: bool = False) -> str:
        """The next process group, through the launcher's store, of the ranks the launcher still
        runs (numbered anew when it went on without one, or took ranks in: ``planned``, as rank 0
        chose them); which ranks raised what (``own``: ``failure`` is this rank's own)."""
        before = int(os.environ["WORLD_SIZE"])
        store = self._store
        if store is None:  # the group never formed (the first build failed): the launcher's store
            store = self._store = self._launcher_store()
        store.set_timeout(datetime.timedelta(seconds=self.restart_timeout_seconds))
        global _generation
        _generation += 1
        prefix = restart_prefix(_generation)
        store.set(f"{prefix}/begun", "1")  # a rank still in the failed run sees it (StuckGuard)
        if not planned and (own or not any(words in failure for words in PEER_FAILURE)):  # not a peer's failure
            store.set(f"{prefix}/cause/{SLOT}", f"{time.time()!r} {failure}")  # when: the first raiser is named first
        named = None
        if planned:
            named, self._changes = chosen(store, f"{prefix}/members")
        slots = await_members(store, f"{prefix}/arrived", before, self.restart_timeout_seconds, named)
        rank, world = slots.index(SLOT), len(slots)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))  # the rebuilt run's, as a launcher sets them
        backend = self._backend or ("nccl" if torch.cuda.is_available() else "gloo")
        timeout = datetime.timedelta(seconds=self._timeout)
        group_store = dist.PrefixStore(f"{prefix}/group", store)  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=group_store, rank=rank, world_size=world, timeout=timeout)
        dist.barrier()  # every rank has joined, so every cause is written
        store.set(f"{_attempt_keys()}/latest", f"{_generation} {self._restarts}")  # for a replacement
        written = [(store.get(k).decode(), s) for s in slots if store.check([k := f"{prefix}/cause/{s}"])]
        timed = sorted((float(text.split(" ", 1)[0]), s, text.split(" ", 1)[1]) for text, s in written)
        causes = [f"rank {s} {failure}" for _, s, failure in timed]  # the first to raise, then any bystander's
        if planned:
            return f"{world - before} rank(s) joined; {world} ranks go on (was {before})"
        shrunk = f"; {world} of {before} ranks go on (the launcher runs no more)" if world < before else ""
        return ("; ".join(causes) or f"a peer's failure (this rank {failure})") + shrunk

    @hookimpl
    def on_resume(self, step: int) -> None:
        self._said_resumed(step)

    @hookimpl(tryfirst=True)
    def on_train_start(self, run: Run) -> None:
        """gloo's connections to the peers, connected by now (the model's wrapping and the resume
        used them) and before logging backends open connections of their own."""
        self._connections = self._gloo_connections()
        self._said_resumed(run.state.step)  # no checkpoint to resume from: from the start
        if self._guard is None and self._store is not None:
            self._guard = StuckGuard(
                self._store, lambda: f"{restart_prefix(_generation + 1)}/begun", self.stuck_seconds
            )
        if self._guard is not None:
            self._guard.step = run.state.step

    @hookimpl
    def pre_step(self, step: int) -> None:
        if self._guard is not None:
            self._guard.step = step

    def _gloo_connections(self) -> dict[int, int]:
        if self._backend != "gloo" or "MASTER_PORT" not in os.environ:
            return {}
        return tcp_connections(except_port=int(os.environ["MASTER_PORT"]))

    def _said_restart(self, cause: str) -> None:
        self._what = f"in-process restart {self._restarts}"
        _say("in-process restart %d/%d after %s", self._restarts, self.max_restarts, cause)

    def _said_reformed(self, change: str) -> None:
        self._what = "in-process re-form"
        _say("in-process re-form: %s", change)

    def _said_resumed(self, step: int) -> None:
        if self._since is not None:
            seconds, self._since = time.monotonic() - self._since, None
            after = "stop" if self._what.endswith("re-form") else "failure"
            _say("%s: resumed at step %d, %.2f s after the %s", self._what, step, seconds, after)

    @hookimpl(tryfirst=True)
    def on_log(self, metrics: dict[str, float]) -> None:
        if self._restarts:
            metrics["inprocess_restarts"] = float(self._restarts)
