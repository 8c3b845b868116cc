"""This group's torchft ``Manager``: connected to the lighthouse and to the group's own store,
dropping the rank's connections when a collective fails, its expected errors kept off the console."""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from coretrain import Run, UserError
from coretrain_torchft.transfer import weights_only_transport


class Connection(NamedTuple):
    """The manager, its process group, and the store this process made (None: torchrun's)."""

    manager: Any
    pg: Any
    store: Any


def connect(
    run: Run,
    group: int,
    lighthouse: str,
    *,
    timeout_seconds: float,
    quorum_timeout_seconds: float,
    min_replicas: int,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
) -> Connection:
    """A manager for replica group ``group``: ``state_dict`` is what a recovering group is sent,
    ``load_state_dict`` how this one applies what it receives."""
    from torchft import Manager, ProcessGroupGloo

    for name in ("torchft.manager", "torchft.process_group"):
        logging.getLogger(name).addFilter(_expected_failures)
    timeout = datetime.timedelta(seconds=timeout_seconds)
    address, port, store = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT"), None
    if address is None or port is None or run.dist.world_size == 1:  # one process: a store of its own
        store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # type: ignore[attr-defined]
        address, port = "localhost", str(store.port)
    pg = ProcessGroupGloo(timeout=timeout)
    try:
        manager = Manager(
            pg=pg,
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=min_replicas,
            use_async_quorum=False,  # a state received is applied before the step, not in its middle
            timeout=timeout,
            connect_timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=quorum_timeout_seconds),
            rank=run.dist.rank,
            world_size=run.dist.world_size,
            store_addr=address,
            store_port=int(port),
            lighthouse_addr=lighthouse,
            replica_id=f"replica_group_{group}",
            checkpoint_transport=weights_only_transport(timeout),
            init_sync=False,  # every group starts from the same seeded weights
        )
    except RuntimeError as exc:  # torchft's: it could not reach the lighthouse (or this group's store)
        raise UserError(
            f"plugins.torchft: the lighthouse at {lighthouse} did not answer within timeout_seconds "
            f"({timeout_seconds:g}s: {str(exc).split(';')[0][:200]}); start it "
            "(`torchft_lighthouse --min_replicas 1`) or point TORCHFT_LIGHTHOUSE at it"
        ) from None
    _abort_on_errors(manager, pg)
    return Connection(manager, pg, store)


def _abort_on_errors(manager: Any, pg: Any) -> None:
    """A collective that fails (a peer group died) drops this rank's connections at once, so that
    the ranks still waiting in it fail now, not at the gloo timeout: torchft reports every
    failed collective to ``Manager.report_error`` (the gradients, the syncs, the exchanges)."""
    report = manager.report_error

    def report_and_abort(error: Exception) -> None:
        first = manager.errored() is None
        report(error)
        if first:
            pg.abort()

    manager.report_error = report_and_abort


def _expected_failures(record: logging.LogRecord) -> bool:
    """torchft's errors about a peer group that failed are what this plugin expects and says in a line
    of its own (the step runs again; the group left): kept in the run's log, off the console."""
    if record.levelno >= logging.WARNING:
        record.levelno, record.levelname, record.exc_info, record.exc_text = logging.INFO, "INFO", None, None
    return True
