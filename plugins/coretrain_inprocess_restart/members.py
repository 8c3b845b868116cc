"""Who forms the next group: every rank of the job, or those the launcher still runs.

coretrain's launcher with ``--min-ranks M`` goes on without a rank whose process died and could
not be replaced: it writes the ranks it runs (their first rank numbers, their *slots*) under
:data:`MEMBERS_KEY`; the others form the next group without it, numbered anew in slot order, so
the data-parallel size shrinks and the run, rebuilt in-process, takes the new size as a job
restarted on it would. Without that key (torchrun) every rank of the job is a member."""

from __future__ import annotations

import os
import time
from typing import Any

MEMBERS_KEY = "coretrain/launch/members"
"""The launcher's ranks, as slots joined by commas ("0,2,3"), read through the store's
``default_pg`` prefix (where a first group's ``env://`` store keeps its keys)."""

SLOT = int(os.environ.get("RANK", "0"))
"""This process's rank when it started: its place in the launcher's list, whatever it is now."""


def members(store: Any, world: int) -> list[int]:
    """The slots forming the next group, in order."""
    if store.check([MEMBERS_KEY]):
        return [int(slot) for slot in store.get(MEMBERS_KEY).decode().split(",")]
    return list(range(world))


def await_members(store: Any, arrived_key: str, world: int, seconds: float) -> list[int]:
    """Count this rank in at ``arrived_key``, wait until every member has (a rank the launcher
    drops while the others wait is no longer awaited) and say who they are."""
    store.add(arrived_key, 1)
    deadline = time.monotonic() + seconds
    while True:
        wanted = members(store, world)
        arrived = int(store.add(arrived_key, 0))
        if arrived >= len(wanted):
            return wanted
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{arrived} of {len(wanted)} ranks arrived at the restart within {seconds:.0f} s "
                "(restart_timeout_seconds); the others are gone or stuck"
            )
        time.sleep(0.05)
