"""``--replace-failed-ranks``: one machine's ranks, a process that dies replaced on its own.

torchrun's agent starts and stops its workers as one group: when one dies (SIGKILL, the OOM
killer) it stops the others and starts them all again, so every rank re-imports torch, builds
the model and the data and loads the checkpoint again. Its process context cannot start one
worker anew, so this launcher is coretrain's own (a few hundred lines, one machine): it serves
the job's store itself (as torchrun's agent does, so the store outlives any rank, rank 0 too),
starts the ranks with torchrun's environment, and when one dies starts a new process for that
rank alone. The other ranks, with ``[plugins.inprocess-restart]``, see the broken connection,
leave the run and wait in-process for the new process to join the group they re-form.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from coretrain import UserError
from coretrain_launch.codes import HANG_EXIT_CODE, STOP_CODES, STOP_SIGNALS, USAGE_EXIT_CODE
from coretrain_launch.errordir import error_dir

MEMBERS_KEY = "default_pg/coretrain/launch/members"
"""The ranks this launcher runs, as their first rank numbers joined by commas ("+3": waits to
join): ``inprocess-restart`` re-forms the group of these (under torch's prefix for a first
group's store keys)."""

STOP_GRACE_SECONDS = 15.0
"""How long the ranks have to end after SIGTERM when the job ends on a failure; then SIGKILL."""


def check_replacing(args: Any, plugins: dict[str, dict[str, Any]]) -> None:
    """``--replace-failed-ranks`` needs one machine, replacements to make, and ranks that wait."""
    most = int((args.nnodes or "1").rpartition(":")[2]) * (args.nproc_per_node or 1)
    if (args.nnodes or "1") != "1" and not args.rdzv_endpoint:
        raise UserError("--replace-failed-ranks across machines: add --rdzv-endpoint HOST:PORT, where they meet")
    if (args.nnodes or "1") == "1" and args.rdzv_endpoint:
        raise UserError("--replace-failed-ranks on one machine: leave out --rdzv-endpoint (it serves its own)")
    if args.node_rank is not None:
        raise UserError("--replace-failed-ranks: machines are numbered as they come; leave out --node-rank")
    if args.min_ranks is not None and not 1 <= args.min_ranks <= most:
        raise UserError(f"--min-ranks {args.min_ranks}: expected 1..{most} (machines × --nproc-per-node)")
    if args.max_restarts < 1 and args.min_ranks is None and not args.rdzv_endpoint:  # (machines: come and go)
        raise UserError(
            "--replace-failed-ranks: add --max-restarts K, how many processes may be replaced in all "
            "(or --min-ranks M, to go on without them)"
        )
    table = plugins.get("inprocess-restart")
    if table is None or table.get("enabled", True) is False:
        raise UserError(
            "--replace-failed-ranks: the other ranks wait for a new process only with in-process restarts; "
            "add [plugins.inprocess-restart] to the config"
        )


def ended(code: int) -> str:
    """How a process ended, in a few words: ``SIGKILL``, ``exit code 1``."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def edit_members(store: Any, edit: Callable[[list[str]], list[str]]) -> None:
    """Change the member list at once (another launcher, or rank 0 taking ranks in, may edit it
    meanwhile: compare-and-set until no one did)."""
    while True:
        listed = store.get(MEMBERS_KEY).decode()
        edited = ",".join(edit([each for each in listed.split(",") if each]))
        if store.compare_set(MEMBERS_KEY, listed, edited).decode() == edited:
            return


def drop_member(store: Any, slot: int) -> None:
    """Take ``slot`` off the members (waiting to join or not)."""
    edit_members(store, lambda listed: [each for each in listed if each.lstrip("+") != str(slot)])


def serve_store(host: str, port: int, seconds: float) -> Any:
    """A TCPStore served by this process (``port`` 0: a free one)."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=seconds)
    return dist.TCPStore(host, port, None, True, timeout=timeout, wait_for_workers=False)  # type: ignore[attr-defined]


def members(store: Any) -> list[str]:
    """The job's ranks (slots) now, not counting those waiting to join."""
    return [each for each in store.get(MEMBERS_KEY).decode().split(",") if each and each[0] != "+"]


class Ranks:
    """The job's processes on this machine, one per rank: one that dies replaced alone, all
    started again after a hang; up to ``max_replacements`` times in all."""

    before_exec: Callable[[], None] | None = None
    """Run in a rank's process before it starts (None: nothing; a rank then stops with its
    launcher as the watchdog has it: every rank checkpoints and stops)."""

    def __init__(self, command: list[str], nproc: int, max_replacements: int, run_id: str, min_ranks: int) -> None:
        self.command, self.nproc, self.max_replacements, self.min_ranks = command, nproc, max_replacements, min_ranks
        self.first_slot = 0
        """This machine's first rank (its ranks are ``first_slot`` .. ``+ nproc - 1``)."""
        self.errors = error_dir()
        self.env = dict(os.environ) | {
            "MASTER_ADDR": "127.0.0.1",
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default",
            "ROLE_WORLD_SIZE": str(nproc),
            "TORCHELASTIC_RUN_ID": run_id,
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": str(max_replacements),
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank a client of this process's store
        }
        self.env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several ranks
        self.processes: dict[int, subprocess.Popen[bytes]] = {}
        self.replaced: dict[int, int] = {}
        self.job_restarts = 0
        self.stopping: int | None = None
        self.store: Any = None

    def _serve(self) -> Any:
        """A store for this attempt of the job (a new one for each, as torchrun's agent makes: a
        group formed again on the old one's keys would meet the dead attempt's)."""
        store = serve_store("127.0.0.1", 0, 30 * 60)
        self.env["MASTER_PORT"] = str(store.port)
        store.set(MEMBERS_KEY, ",".join(str(rank) for rank in range(self.nproc)))
        return store

    @property
    def spent(self) -> int:
        """Replacements and job restarts made: each counts against ``--max-restarts``."""
        return sum(self.replaced.values()) + self.job_restarts

    def start(self, rank: int, predecessor: str | None = None, extra: dict[str, str] | None = None) -> None:
        local = str(rank - self.first_slot)
        env = self.env | {"RANK": str(rank), "LOCAL_RANK": local, "ROLE_RANK": str(rank)} | (extra or {})
        env["TORCHELASTIC_ERROR_FILE"] = str(self.error_file(rank))
        if predecessor is not None:
            self.replaced[rank] = self.replaced.get(rank, 0) + 1
            env |= {"CORETRAIN_REPLACEMENT": str(self.replaced[rank]), "CORETRAIN_REPLACED": predecessor}
        self.error_file(rank).unlink(missing_ok=True)
        self.processes[rank] = subprocess.Popen(self.command, env=env, preexec_fn=self.before_exec)

    def error_file(self, rank: int) -> Path:
        return self.errors / f"rank{rank}.json"

    def forward(self, signum: int, _frame: FrameType | None = None) -> None:
        """Pass a signal on (the ranks save a checkpoint and stop); a second one kills them."""
        again, self.stopping = self.stopping is not None, signum
        self.signal_all(signal.SIGKILL if again else signum)

    def signal_all(self, signum: int) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signum)

    def watch(self, failed: Callable[[Any], int]) -> int:
        """Wait for the ranks; replace one that dies while the others train. The job's exit code
        (``failed`` makes it from torch's ``ChildFailedError``, as torchrun's is read)."""
        done: set[int] = set()
        failures: list[tuple[int, int]] = []
        while len(done) + len(failures) < len(self.processes):
            time.sleep(0.1)
            if self.tick():  # every rank started anew
                done, failures = set(), []
            for rank, process in self.processes.items():
                code = process.poll()
                if code is None or rank in done or rank in dict(failures):
                    continue
                ending = bool(done or failures)
                if code == 0:
                    done.add(rank)
                elif self._replaceable(code, ending):
                    if code == HANG_EXIT_CODE:  # a new process alone would wait for a frozen peer
                        self._restart_all(rank)
                    else:
                        self._replace(rank, code)
                    break  # the processes changed
                elif self._droppable(code, ending):
                    self._drop(rank, code)
                    break
                else:
                    failures.append((rank, code))
                    self._end_the_others(failures)
        if self.stopping is not None and all(code == 128 + self.stopping for _, code in failures):
            return 128 + self.stopping
        return failed(self.child_failed(failures)) if failures else 0

    def tick(self) -> bool:
        """Between looks at the ranks: whether they were all started anew (across machines)."""
        return False

    def child_failed(self, failures: list[tuple[int, int]]) -> Any:
        """The ranks that failed, as torchrun reports them (with what each wrote in its error file)."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

        found = {}
        for order, (rank, code) in enumerate(failures):
            failure = ProcessFailure(rank, self.processes[rank].pid, code, str(self.error_file(rank)))
            if "timestamp" not in failure.error_file_data:
                failure.timestamp = order  # the first to fail is the first failure
            found[rank] = failure
        return ChildFailedError("coretrain", found)

    def _final(self, code: int, ending: bool) -> bool:
        """Nothing is started again after a mistake (exit 2) or a stop as agreed, nor while the
        job ends (a rank completed, or another failed for good) or stops on a signal."""
        return code in (USAGE_EXIT_CODE, *STOP_CODES) or ending or self.stopping is not None

    def _replaceable(self, code: int, ending: bool) -> bool:
        return not self._final(code, ending) and self.spent < self.max_replacements

    def _droppable(self, code: int, ending: bool) -> bool:
        """Whether the job goes on without a rank that died: as many ranks left as ``--min-ranks``
        asks, and not after a hang (the watchdog's rank may have named a frozen peer, still there)."""
        enough = len(members(self.store)) - 1 >= self.min_ranks
        return not self._final(code, ending) and code != HANG_EXIT_CODE and enough

    def _drop(self, rank: int, code: int) -> None:
        del self.processes[rank]
        drop_member(self.store, rank)
        print(
            f"coretrain: rank {rank} ended ({ended(code)}) and no replacement is left; the other "
            f"{len(members(self.store))} rank(s) go on without it (--min-ranks {self.min_ranks})",
            file=sys.stderr,
            flush=True,
        )

    def _replace(self, rank: int, code: int) -> None:
        made = self.spent + 1
        print(
            f"coretrain: rank {rank} ended ({ended(code)}); starting a new process in its place "
            f"({made}/{self.max_replacements}), the other ranks wait for it",
            file=sys.stderr,
            flush=True,
        )
        self.start(rank, predecessor=f"{time.time():.3f} {ended(code)}")

    def _restart_all(self, rank: int) -> None:
        """Every rank started again, as torchrun does: the watchdog ended ``rank`` on a hang,
        its own or a frozen peer's, which a new process alone would wait for in vain."""
        self.job_restarts += 1
        print(
            f"coretrain: rank {rank} ended on a hang (exit {HANG_EXIT_CODE}); starting every rank again "
            f"({self.spent}/{self.max_replacements})",
            file=sys.stderr,
            flush=True,
        )
        self.signal_all(signal.SIGKILL)
        for process in self.processes.values():
            process.wait()
        self.env["TORCHELASTIC_RESTART_COUNT"] = str(self.job_restarts)
        self.nproc = len(self.processes)  # (fewer, if the job went on without some)
        self.processes, self.env["WORLD_SIZE"] = {}, str(self.nproc)
        self.store = self._serve()
        for each in range(self.nproc):
            self.start(each)

    def _end_the_others(self, failures: list[tuple[int, int]]) -> None:
        """A failure that ends the job: the others are told to stop (a stop as agreed saves a
        checkpoint), then killed if they have not ended in ``STOP_GRACE_SECONDS``."""
        if len(failures) > 1 or self.stopping is not None:
            return
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while time.monotonic() < deadline and any(p.poll() is None for p in self.processes.values()):
            time.sleep(0.1)
        self.signal_all(signal.SIGKILL)


def launch_replacing(args: Any, command: list[str], failed: Callable[[Any], int]) -> int:
    """Run ``command`` as ``--nproc-per-node`` ranks on this machine; the job's exit code."""
    ranks = Ranks(
        command, args.nproc_per_node or 1, args.max_restarts, args.rdzv_id, args.min_ranks or args.nproc_per_node or 1
    )
    ranks.store = ranks._serve()
    previous = {signum: signal.signal(signum, ranks.forward) for signum in STOP_SIGNALS}
    try:
        for rank in range(ranks.nproc):
            ranks.start(rank)
        return ranks.watch(failed)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        ranks.signal_all(signal.SIGKILL)
        shutil.rmtree(ranks.errors, ignore_errors=True)
