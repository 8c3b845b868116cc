"""``--replace-failed-ranks`` across machines (``--nnodes MIN:MAX --rdzv-endpoint HOST:PORT``):
a machine that joins or leaves changes the job in-process.

torchrun's agents start every rank again when a machine joins or leaves (a new rendezvous
round). Here each machine's launcher is a :class:`Machine`, and the one on the endpoint's host
also leads (:class:`Leader`): it serves the meeting store (which machines came, their
heartbeats) and each attempt's store for the ranks, decides which machines are in, and writes
their ranks where the ranks' ``inprocess-restart`` reads them. A machine that joins gets rank
numbers after the others', listed as waiting ("+4"); the running ranks stop together with a
checkpoint and form the next group with its ranks. A machine whose heartbeat stops (its
launcher killed, the machine gone) has its ranks dropped; the others, which saw the broken
connection, form the next group without them — unless that leaves fewer than MIN machines: then
they wait for a machine that comes to take its place (its ranks get the gone ones' numbers and
join as replaced processes do). A hang (exit 124) starts every rank on every machine again on a
new store, as torchrun would. The machine hosting the endpoint must stay,
as with torchrun's c10d rendezvous. Settings are torchrun's ``--rdzv-conf`` names.
"""

from __future__ import annotations

import ctypes
import datetime
import shutil
import signal
import sys
import time
from typing import Any

from coretrain import UserError
from coretrain_launch.endpoint import rdzv_settings
from coretrain_launch.replacing import MEMBERS_KEY, Ranks, drop_member, edit_members, members, serve_store

CHANGES_KEY = "default_pg/coretrain/launch/changes"
"""How many times machines were taken in (``inprocess-restart`` stops the ranks when it grows)."""

READY_KEY = "default_pg/coretrain/launch/ready"
"""Counts the ranks of joining machines that have started and wait to be taken in."""

SETTINGS = {"join_timeout": 600.0, "last_call_timeout": 30.0, "keep_alive_interval": 1.0, "keep_alive_max_attempt": 3}
"""torchrun's rendezvous settings this launcher takes from ``--rdzv-conf``, with torchrun's defaults."""


class Meeting:
    """The endpoint's store, served by the launcher on its host (the first to bind the port):
    the machines that came, their heartbeats, the leader's plans."""

    def __init__(self, endpoint: str, run_id: str, settings: dict[str, float]) -> None:
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

        self.host, port = parse_rendezvous_endpoint(endpoint, 29400)
        self.leads, seconds = False, settings["join_timeout"]
        if _matches_machine_hostname(self.host):
            try:
                self.store, self.leads = serve_store(self.host, port, seconds), True
            except RuntimeError:  # taken: another launcher on this host serves it
                pass
        if not self.leads:
            timeout = datetime.timedelta(seconds=seconds)
            self.store = dist.TCPStore(self.host, port, None, False, timeout=timeout)  # type: ignore[attr-defined]
        self.keys = dist.PrefixStore(f"coretrain/launch/{run_id}", self.store)  # type: ignore[attr-defined]
        self.machine = int(self.keys.add("machines", 1)) - 1
        self.every, self.beaten = settings["keep_alive_interval"], 0.0

    def beat(self) -> None:
        """This machine's heartbeat, every ``keep_alive_interval``."""
        if time.monotonic() - self.beaten >= self.every:
            self.keys.set(f"beat/{self.machine}", str(time.monotonic_ns()))
            self.beaten = time.monotonic()

    def read(self, key: str) -> str | None:
        return self.keys.get(key).decode() if self.keys.check([key]) else None


def _say(message: str) -> None:
    print(f"coretrain: {message}", file=sys.stderr, flush=True)


class Leader:
    """The endpoint host's launcher: which machines are in the job, and the ranks' store."""

    def __init__(self, meeting: Meeting, nproc: int, nnodes: tuple[int, int], settings: dict[str, float]) -> None:
        self.meeting, self.nproc, (self.low, self.high), self.settings = meeting, nproc, nnodes, settings
        self.first_slots: dict[int, int] = {}
        """The machines in the job, in order, and the first rank of each."""
        self.gone: set[int] = set()
        self.heard: dict[int, tuple[str | None, float]] = {}
        self.attempt, self.restarts_seen, self.next_slot = 0, 0, 0
        self.stores: list[Any] = []
        self.joining = 0
        """Ranks taken in whose processes have not all started yet (the ranks go on training meanwhile)."""
        self.vacant: list[tuple[int, int]] = []
        """Machines that left a job with fewer than MIN, and their first ranks: a machine that comes takes
        their place (the ranks wait for it, up to their ``restart_timeout_seconds``)."""
        self.began, self.enough_at = time.monotonic(), 0.0

    def tick(self) -> None:
        keys = self.meeting.keys
        alive = [m for m in range(int(keys.add("machines", 0))) if m not in self.gone and self._alive(m)]
        if self.attempt == 0:
            self._first_plan(alive)
            return
        for machine in [m for m in self.first_slots if m not in alive and self.meeting.read(f"done/{m}") is None]:
            self._left(machine)
        for machine in [m for m in alive if m not in self.first_slots][: self.high - len(self.first_slots)]:
            if self.vacant:
                self._take_place(machine, *self.vacant.pop(0))
            else:
                self._take_in(machine)
        if self.joining and int(self.stores[-1].add(READY_KEY, 0)) >= self.joining:
            self.stores[-1].add(READY_KEY, -self.joining)
            self.stores[-1].add(CHANGES_KEY, 1)  # all started: the ranks stop and take them in now
            self.joining = 0
        asked = int(keys.add("restarts", 0))
        if asked > self.restarts_seen:
            self.restarts_seen = asked
            self._plan()

    def _alive(self, machine: int) -> bool:
        """Whether the machine's heartbeat changed within ``keep_alive_interval × keep_alive_max_attempt``
        (as this machine's clock sees it: the machines' clocks need not agree)."""
        beat, now = self.meeting.read(f"beat/{machine}"), time.monotonic()
        last = self.heard.get(machine)
        if last is None or last[0] != beat:
            self.heard[machine] = (beat, now)
            return True
        return now - last[1] <= self.settings["keep_alive_interval"] * self.settings["keep_alive_max_attempt"]

    def _first_plan(self, alive: list[int]) -> None:
        """Start once MIN machines came and ``last_call_timeout`` passed (or MAX came)."""
        now = time.monotonic()
        if len(alive) >= self.low:
            self.enough_at = self.enough_at or now
            if len(alive) >= self.high or now - self.enough_at >= self.settings["last_call_timeout"]:
                self.first_slots = dict.fromkeys(alive[: self.high], 0)
                self._plan()
        elif now - self.began > self.settings["join_timeout"]:
            raise UserError(
                f"--nnodes {self.low}:{self.high}: {len(alive)} machine(s) came within join_timeout "
                f"{self.settings['join_timeout']:.0f} s; start the others, or raise it (--rdzv-conf join_timeout=...)"
            )

    def _plan(self) -> None:
        """A new attempt: every machine in the job starts its ranks, numbered in machine order,
        on a new store (a group formed again on the old one's keys would meet the dead attempt's)."""
        self.attempt += 1
        for order, machine in enumerate(self.first_slots):
            self.first_slots[machine] = order * self.nproc
        world = self.next_slot = len(self.first_slots) * self.nproc
        store = serve_store(self.meeting.host, 0, self.settings["join_timeout"])
        store.set(MEMBERS_KEY, ",".join(str(rank) for rank in range(world)))
        store.add(CHANGES_KEY, 0)
        self.joining = 0
        self.stores = [*self.stores[-1:], store]  # the previous one until its ranks are gone
        machines = ",".join(f"{m}:{first}" for m, first in self.first_slots.items())
        self.meeting.keys.set(f"plan/{self.attempt}", f"{store.port} {world} {machines}")
        self.meeting.keys.set("attempt", str(self.attempt))

    def _take_in(self, machine: int) -> None:
        """A machine that came while the job runs: its ranks listed as waiting; the ranks stop
        with a checkpoint and take them in."""
        store, first = self.stores[-1], self.next_slot
        self.first_slots[machine], self.next_slot = first, first + self.nproc
        edit_members(store, lambda listed: [*listed, *(f"+{slot}" for slot in range(first, first + self.nproc))])
        self.joining += self.nproc
        self.meeting.keys.set(f"start/{machine}", f"{self.attempt} {first} {len(members(store))} joined")
        _say(
            f"machine {machine} joined: once its {self.nproc} rank(s) have started, the ranks stop with a "
            "checkpoint and take them in"
        )

    def _take_place(self, machine: int, gone: int, first: int) -> None:
        """A machine that came while the ranks wait for a gone one's: its ranks take those rank
        numbers and join the restart the others are in, as a dead rank's replacement does."""
        self.first_slots[machine] = first
        world = len(members(self.stores[-1]))
        self.meeting.keys.set(f"start/{machine}", f"{self.attempt} {first} {world} replaces {gone}")
        _say(f"machine {machine} came: its ranks take the place of machine {gone}'s")

    def _left(self, machine: int) -> None:
        """A machine whose heartbeat stopped: the others go on without its ranks, if enough remain."""
        first = self.first_slots.pop(machine)
        self.gone.add(machine)
        silent = self.settings["keep_alive_interval"] * self.settings["keep_alive_max_attempt"]
        if len(self.first_slots) < self.low:
            self.vacant.append((machine, first))
            _say(
                f"machine {machine} left (no heartbeat for {silent:.0f} s): fewer than {self.low} machines "
                "remain (--nnodes); the ranks wait for a machine to take its place (restart_timeout_seconds)"
            )
            return
        for slot in range(first, first + self.nproc):
            drop_member(self.stores[-1], slot)
        _say(f"machine {machine} left (no heartbeat for {silent:.0f} s): the other ranks go on without its ranks")

    def finish(self) -> None:
        """This machine's ranks are done, so the job is: the machines whose ranks wait to be taken
        in are told to stop them (``over``: they will never be); the stores stay up until every
        machine's ranks are done (or the machine is gone)."""
        waiting = {int(each[1:]) for each in self.stores[-1].get(MEMBERS_KEY).decode().split(",") if each[:1] == "+"}
        self.meeting.keys.set("over", ",".join(str(m) for m, first in self.first_slots.items() if first in waiting))
        while any(self.meeting.read(f"done/{m}") is None and self._alive(m) for m in self.first_slots):
            self.meeting.beat()
            time.sleep(0.1)


_prctl = ctypes.CDLL(None, use_errno=True).prctl  # found before any fork


def _killed_with_launcher() -> None:
    """In a rank's process before it runs: SIGKILL when the launcher dies (prctl's
    PR_SET_PDEATHSIG; the watchdog then leaves it, not asking for its SIGTERM, a stop every
    rank agrees to)."""
    _prctl(1, int(signal.SIGKILL))


class Machine(Ranks):
    """This machine's ranks in a job across machines: started as the leader's plans say."""

    before_exec = staticmethod(_killed_with_launcher)  # a machine that leaves: its ranks go, the others go on

    def __init__(self, command: list[str], nproc: int, args: Any, meeting: Meeting, leader: Leader | None) -> None:
        most = int(args.nnodes.rpartition(":")[2]) * nproc
        super().__init__(command, nproc, args.max_restarts, args.rdzv_id, args.min_ranks or most)
        self.meeting, self.leader, self.attempt = meeting, leader, 0
        self.env["MASTER_ADDR"] = meeting.host

    def tick(self) -> bool:
        self.meeting.beat()
        if self.leader is not None:
            self.leader.tick()
        over = self.meeting.read("over")
        if over is not None and (not self.processes or str(self.meeting.machine) in over.split(",")):
            self.signal_all(signal.SIGKILL)  # ranks that wait to be taken in hold nothing of the job's
            for process in self.processes.values():
                process.wait()
            self.processes = {}
            _say("the job ended before this machine's ranks were taken in")
            return True
        attempt = int(self.meeting.read("attempt") or 0)
        if attempt > self.attempt:
            self._follow(attempt)
            return True
        plan = (self.meeting.read(f"start/{self.meeting.machine}") or "").split()
        if not self.processes and plan and int(plan[0]) == self.attempt:
            (first, world), now = (int(n) for n in plan[1:3]), f"{time.time():.3f}"
            self.first_slot, self.env["WORLD_SIZE"] = first, str(world)
            replaced = {"CORETRAIN_REPLACED": f"{now} machine {plan[-1]} left"}  # (its ranks' places)
            for slot in range(first, first + self.nproc):
                self.start(slot, extra={"CORETRAIN_JOINED": now} if plan[3] == "joined" else replaced)
            return True
        return False

    def wait_admitted(self) -> None:
        while not self.processes and self.meeting.read("over") is None:
            self.tick()
            time.sleep(0.1)

    def _follow(self, attempt: int) -> None:
        """The leader's plan for ``attempt``: this machine's ranks (all of them) started anew."""
        import torch.distributed as dist

        port, world, machines = (self.meeting.read(f"plan/{attempt}") or "").split()
        firsts = {int(m): int(first) for m, _, first in (pair.partition(":") for pair in machines.split(","))}
        self.signal_all(signal.SIGKILL)
        for process in self.processes.values():
            process.wait()
        self.processes, self.attempt, self.job_restarts = {}, attempt, attempt - 1
        self.env |= {"MASTER_PORT": port, "WORLD_SIZE": world, "TORCHELASTIC_RESTART_COUNT": str(attempt - 1)}
        self.env |= {"GROUP_WORLD_SIZE": str(len(firsts)), "ROLE_WORLD_SIZE": world}
        timeout = datetime.timedelta(seconds=60)
        self.store = dist.TCPStore(self.meeting.host, int(port), None, False, timeout=timeout)  # type: ignore[attr-defined]
        if self.meeting.machine in firsts:
            self.first_slot = firsts[self.meeting.machine]
            self.env["GROUP_RANK"] = str(list(firsts).index(self.meeting.machine))
            for slot in range(self.first_slot, self.first_slot + self.nproc):
                self.start(slot)

    def _restart_all(self, rank: int) -> None:
        """A hang: the leader starts every rank of every machine again (see :meth:`_follow`)."""
        _say(
            f"rank {rank} ended on a hang (exit 124); starting every rank of every machine again "
            f"({self.spent + 1}/{self.max_replacements})"
        )
        self.meeting.keys.add("restarts", 1)
        while not self.tick():
            time.sleep(0.1)


def launch_machines(args: Any, command: list[str], config: Any, failed: Any) -> int:
    """This machine's part of a job across machines; its ranks' exit code."""
    from coretrain_launch.codes import STOP_SIGNALS
    from coretrain_launch.endpoint import check_endpoint

    check_endpoint(args.rdzv_endpoint, args.rdzv_conf)  # a port another program holds: one error
    low, _, high = args.nnodes.partition(":")
    most = config.distributed.resolved_strategy(int(high or low) * (args.nproc_per_node or 1))
    if config.distributed.strategy == "auto" and most is not None:  # resolved for the size the job may grow to
        command = [*command, "--set", f"distributed.strategy={most}"]
    settings = rdzv_settings(args.rdzv_conf, SETTINGS)
    meeting = Meeting(args.rdzv_endpoint, args.rdzv_id, settings)
    leader = (
        Leader(meeting, args.nproc_per_node or 1, (int(low), int(high or low)), settings) if meeting.leads else None
    )
    ranks = Machine(command, args.nproc_per_node or 1, args, meeting, leader)
    previous = {signum: signal.signal(signum, ranks.forward) for signum in STOP_SIGNALS}
    try:
        ranks.wait_admitted()
        code = ranks.watch(failed)
        meeting.keys.set(f"done/{meeting.machine}", str(code))
        if leader is not None:
            leader.finish()
        return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        ranks.signal_all(signal.SIGKILL)
        shutil.rmtree(ranks.errors, ignore_errors=True)
