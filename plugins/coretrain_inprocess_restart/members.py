"""Who forms the next group: every rank of the job, or those the launcher runs.

coretrain's launcher (``--replace-failed-ranks``) writes the ranks it runs under
:data:`MEMBERS_KEY`, as their first rank numbers (their *slots*). With ``--min-ranks M`` it goes
on without a rank whose process died and could not be replaced, so the others form the next
group without it, numbered anew in slot order: the data-parallel size shrinks and the run,
rebuilt in-process, takes the new size as a job restarted on it would. Across machines
(``--nnodes MIN:MAX``) a machine that joins has its slots written with a ``+`` ("0,1,+2,+3"):
the ranks see :data:`CHANGES_KEY` grow, stop together with a checkpoint and take them in at
their next group. Without the key (torchrun) every rank of the job is a member."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

MEMBERS_KEY = "coretrain/launch/members"
"""The launcher's ranks, as slots joined by commas ("0,2,+3": 3 waits to join), read through the
store's ``default_pg`` prefix (where a first group's ``env://`` store keeps its keys)."""

CHANGES_KEY = "coretrain/launch/changes"
"""How many times the launcher has added ranks waiting to join (a counter)."""

READY_KEY = "coretrain/launch/ready"
"""Where a joining rank counts itself in once started, so the ranks stop only when it waits."""

JOINED_ENV = "CORETRAIN_JOINED"
"""Set by the launcher for a process that joins a running job: when (Unix time) it was started."""

SLOT = int(os.environ.get("RANK", "0"))
"""This process's rank when it started: its place in the launcher's list, whatever it is now."""


def members(store: Any, world: int) -> list[int]:
    """The slots forming the next group after a failure, in order (not those waiting to join)."""
    if store.check([MEMBERS_KEY]):
        return [int(slot) for slot in store.get(MEMBERS_KEY).decode().split(",") if slot and slot[0] != "+"]
    return list(range(world))


def changes(store: Any) -> int:
    """How many times ranks were added to join (see :data:`CHANGES_KEY`)."""
    return int(store.add(CHANGES_KEY, 0))


def admit_joining(store: Any) -> list[int]:
    """Take the ranks waiting to join in as members, at once (the launcher may drop one while we
    write); the members now."""
    while True:
        listed = store.get(MEMBERS_KEY).decode()
        admitted = listed.replace("+", "")
        if store.compare_set(MEMBERS_KEY, listed, admitted).decode() == admitted:
            return [int(slot) for slot in admitted.split(",") if slot]


def await_members(
    store: Any, arrived_key: str, world: int, seconds: float, chosen: list[int] | None = None
) -> list[int]:
    """Count this rank in at ``arrived_key``, wait until every member has (``chosen`` ones, or
    the launcher's; a rank the launcher drops while the others wait is no longer awaited) and
    say who they are."""
    store.add(arrived_key, 1)
    deadline = time.monotonic() + seconds
    while True:
        wanted = members(store, world)
        if chosen is not None:
            wanted = [slot for slot in chosen if slot in wanted]
        arrived = int(store.add(arrived_key, 0))
        if arrived >= len(wanted):
            return wanted
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{arrived} of {len(wanted)} ranks arrived at the restart within {seconds:.0f} s "
                "(restart_timeout_seconds); the others are gone or stuck"
            )
        time.sleep(0.05)


def chosen(store: Any, key: str) -> tuple[list[int], int]:
    """The members rank 0 named at ``key`` for a group that takes ranks in, and the launcher's
    count of changes they cover."""
    slots, _, count = store.get(key).decode().partition(";")
    return [int(slot) for slot in slots.split(",")], int(count)


def name_members(store: Any, key: str) -> None:
    """Rank 0, after the ranks stopped to take ranks in: the members of the next group, those
    waiting included, written at ``key`` for every rank (the joining ones too)."""
    count = changes(store)
    store.set(key, f"{','.join(map(str, admit_joining(store)))};{count}")


def await_taken_in(store: Any, latest_key: str, prefix: Callable[[int], str], seconds: float) -> tuple[int, int]:
    """A joining rank: wait until the running ranks name it among the next group's members; the
    generation and restart count of the group they leave (``latest_key``, "0 0" before any)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        latest = store.get(latest_key).decode() if store.check([latest_key]) else "0 0"
        formed, restarts = (int(n) for n in latest.split())
        named = f"{prefix(formed + 1)}/members"
        if store.check([named]) and SLOT in chosen(store, named)[0]:
            return formed, restarts
        time.sleep(0.1)
    raise TimeoutError(f"the running ranks did not take this rank in within {seconds:.0f} s")
