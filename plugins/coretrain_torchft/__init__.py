"""``torchft``: data-parallel replica groups that carry on when one fails, on PyTorch's torchft.

Each replica group is a job of its own (one process, or a torchrun job whose ranks split the
model as usual); torchft's lighthouse holds a quorum of the live groups, step by step. At every
step the groups' gradients are averaged over the quorum (torchft's fault-tolerant all-reduce)
and the update is committed only when every member of the quorum got through the step
(``Manager.should_commit``); a group that dies is dropped from the next quorum and the others
go on with the same step — no process of theirs restarts, no checkpoint is read. A group that
starts while others train (restarted, or a new one) takes the model, optimizer, schedule,
counters and random streams from a live group over torchft's checkpoint transport before its
first step, and from then on trains in step with them::

    [plugins.torchft]
    replica_groups = 2          # the job's groups; each reads its share of every batch

    coretrain run job.toml --nproc-per-node 4 --max-restarts 1    # 2 groups of 2 ranks, here
    REPLICA_GROUP_ID=1 TORCHFT_LIGHTHOUSE=http://host:29510 coretrain run job.toml   # or one group, anywhere

``coretrain run --nproc-per-node`` (``--nnodes``) starts torchft's lighthouse and one torchrun job
per group (:mod:`coretrain_torchft.launch`); elsewhere each group is started with its number and
the lighthouse's address (``torchft_lighthouse --min_replicas 1``). Each group reads every
``replica_groups``-th sample of the train split, its own, so the groups of one step read
different samples; ``train.global_batch_size`` is one group's batch. A step a group missed is
a step its share was not read in: the log says so when it leaves and when it comes back.

What one group's plugins decide — an update vetoed, a whole step skipped, a stop — every group
does at the same step (a signal stays the group's own: a group preempted leaves, the others go on).

``mode = "localsgd"`` or ``"diloco"`` (:mod:`coretrain_torchft.periodic`): each group updates on
its own and the groups meet every ``sync_every`` steps, torchft's LocalSGD and DiLoCo.

What it logs: ``replica groups 2 of 2 at step 1``, ``replica group 1 left the quorum at step 8``,
``replica group 1 joined at step 11, state from replica group 0 (0.4 MB in 0.1 s)``, ``replica
group 1 was restarted: it left and rejoined the quorum at step 8`` (back before a quorum went on
without it), and the
metrics ``replica_groups`` (the quorum's size at the logged step) and
``replica_group_steps_missed`` (steps × groups whose share went unread, so far).

The state a recovering group receives is loaded with ``weights_only=True`` (torchft's own
transport unpickles anything); its checkpoint server answers whoever reaches its port while a
group recovers, as torchft's does: keep the replica groups on a network you trust.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from collections.abc import Callable, Generator
from typing import Any, Literal

import torch
from attrs import define, field

from coretrain import (
    FieldValueError,
    Outcome,
    Run,
    UserError,
    hookimpl,
    in_range,
    is_stream,
    positive,
)
from coretrain_torchft.ddp import agree_on_vetoes, average_and_commit
from coretrain_torchft.launch import ENDED_FILE
from coretrain_torchft.manager import connect
from coretrain_torchft.periodic import PeriodicSync
from coretrain_torchft.share import GroupShare
from coretrain_torchft.transfer import apply_run_state, run_state, tensor_bytes

log = logging.getLogger("coretrain")

GROUP_ENV, LIGHTHOUSE_ENV = "REPLICA_GROUP_ID", "TORCHFT_LIGHTHOUSE"


def _process_mark() -> float:
    """A number for this process in the quorum's exchange, drawn from the OS (the run's seed does
    not reach it), below 2**24 so that float32 holds it exactly."""
    return float(random.SystemRandom().randrange(1, 2**24))


@define(kw_only=True)
class TorchFT:
    """Replica groups under torchft's per-step quorum: a failed group is dropped, the others go on."""

    coretrain_vetoes_updates = True  # a step the quorum did not commit runs again

    replica_groups: int = field(default=2, validator=positive)
    """The job's replica groups; each reads every ``replica_groups``-th sample of the train split."""
    replica_group: int | None = None
    """This group's number, 0 .. replica_groups - 1; unset: ``REPLICA_GROUP_ID`` from the environment."""
    lighthouse: str = ""
    """torchft's lighthouse (``http://host:29510``); empty: ``TORCHFT_LIGHTHOUSE`` from the environment."""
    min_replicas: int = field(default=1, validator=positive)
    """Groups a step needs to commit; with fewer the step waits and runs again."""
    timeout_seconds: float = field(default=30.0, validator=positive)
    """A collective, a commit or a state transfer that takes longer fails (the step runs again)."""
    quorum_timeout_seconds: float = field(default=60.0, validator=positive)
    """How long a step waits for a quorum of ``min_replicas`` groups (localsgd, diloco: also how long a
    group that comes back waits for the live groups' next sync: keep it above ``sync_every`` steps)."""
    heartbeat_timeout_seconds: float = field(default=5.0, validator=positive)
    """The lighthouse ``coretrain run --nproc-per-node`` starts drops a group silent this long."""
    agree_stops: bool = True
    """A stop one group's plugins ask for is every group's, at the same step (one tiny exchange
    between the groups per step); false: it is the group's own, like a signal (it leaves, the others go on)."""
    mode: Literal["ddp", "localsgd", "diloco"] = "ddp"
    """"ddp": the groups' gradients averaged at every step. "localsgd": each group updates on its
    own and the groups' weights are averaged every ``sync_every`` steps (torchft's LocalSGD);
    "diloco": every ``sync_every`` steps an outer SGD step on the groups' averaged pseudo-gradients
    (torchft's DiLoCo): for groups on slow links. A group that fails is dropped at the next sync;
    one that comes back joins at a sync."""
    sync_every: int = field(default=100, validator=positive)
    """localsgd, diloco: the groups sync at the boundary after every ``sync_every``-th step (a
    checkpoint of that step holds the group's own weights) and after the run's last step."""
    outer_lr: float = field(default=0.7, validator=positive)
    """diloco: the outer SGD's learning rate (the DiLoCo paper's 0.7)."""
    outer_momentum: float = field(default=0.9, validator=in_range(0.0, 1.0))
    """diloco: the outer SGD's momentum."""
    outer_nesterov: bool = True
    """diloco: Nesterov momentum for the outer SGD, as the paper."""
    _manager: Any = field(default=None, init=False, repr=False)
    _store: Any = field(default=None, init=False, repr=False)
    _pg: Any = field(default=None, init=False, repr=False)
    _run: Run | None = field(default=None, init=False, repr=False)
    _number: int = field(default=0, init=False, repr=False)
    """This group's number, read once (``_group``) when training starts."""
    _marks: dict[int, float] = field(factory=dict, init=False, repr=False)
    """The last quorum's groups -> the mark each one's process put in its exchange (:attr:`_mark`)."""
    _mark: float = field(factory=_process_mark, init=False, repr=False)
    """This process's mark: a group restarted between two quorums comes back with another, though
    the quorum's groups are the same."""
    _quorum: Any = field(default=None, init=False, repr=False)
    _received_bytes: float | None = field(default=None, init=False, repr=False)
    """The size of the state this group took from a live one (None: it took none)."""
    _begun: int | None = field(default=None, init=False, repr=False)
    _averaged: int | None = field(default=None, init=False, repr=False)
    """The step whose gradients this group last averaged with the others' (in before_update)."""
    _left_at: dict[int, int] = field(factory=dict, init=False, repr=False)
    """Group -> the step it left the quorum at, while it is away."""
    _missed: int = field(default=0, init=False, repr=False)
    """Steps times groups whose share was not read (a group away), counted as steps commit."""
    _periodic: PeriodicSync | None = field(default=None, init=False, repr=False)
    """localsgd, diloco: torchft's averaging, run at the syncs."""
    _synced: int = field(default=0, init=False, repr=False)
    """localsgd, diloco: the step of the last sync."""
    _resumed: dict[str, Any] = field(factory=dict, init=False, repr=False)
    """diloco: its state from the checkpoint resumed, applied once the DiLoCo exists."""

    def __attrs_post_init__(self) -> None:
        if self.replica_groups < 2:
            raise FieldValueError(
                "replica_groups", f"{self.replica_groups}: 2 or more groups are needed to carry on without one"
            )
        if self.min_replicas > self.replica_groups:
            groups = self.replica_groups
            raise FieldValueError("min_replicas", f"{self.min_replicas} is more than replica_groups ({groups})")

    # ------------------------------------------------------------------ set-up

    def _group(self) -> int:
        if self.replica_group is not None:
            chosen, where = self.replica_group, "plugins.torchft.replica_group"
        else:
            value = os.environ.get(GROUP_ENV, "")
            if not value.isdigit():
                raise UserError(
                    f"plugins.torchft: which replica group is this? set {GROUP_ENV} (0 .. {self.replica_groups - 1}) "
                    f"in the environment or plugins.torchft.replica_group (got {value!r})"
                )
            chosen, where = int(value), GROUP_ENV
        if chosen >= self.replica_groups:
            groups = self.replica_groups
            raise UserError(f"{where}: {chosen} is not a group of replica_groups = {groups} (0 .. {groups - 1})")
        return chosen

    def _given_lighthouse(self) -> str:
        """The lighthouse's address from the config or the environment; empty when neither names one."""
        return self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")

    def _lighthouse(self) -> str:
        address = self._given_lighthouse()
        if not address:
            raise UserError(
                f"plugins.torchft: no lighthouse; start one (`torchft_lighthouse --min_replicas 1`) and set "
                f"{LIGHTHOUSE_ENV}=http://HOST:29510 or plugins.torchft.lighthouse"
            )
        return address

    @hookimpl
    def launch_job(self, args: argparse.Namespace, loaded: Any, check: Callable[[list[int]], None]) -> int | None:
        """``coretrain run --nproc-per-node N``: a lighthouse (unless one is given) and one torchrun
        job of N / replica_groups ranks per group, each restarted alone (``--max-restarts``)."""
        if GROUP_ENV in os.environ:  # the launcher of one group (started by the one below): torchrun, as usual
            return None
        from coretrain_torchft.launch import launch_groups

        given = self._given_lighthouse()
        grace = self.timeout_seconds + self.heartbeat_timeout_seconds
        return launch_groups(args, loaded, check, self.replica_groups, given or self.lighthouse_settings(), grace)

    def lighthouse_settings(self) -> dict[str, int]:
        """The flags of the lighthouse the launcher starts, from this table."""
        return {
            "min_replicas": self.min_replicas,
            "join_timeout_ms": int(self.timeout_seconds * 1000),  # a live group slower than this is left out
            "heartbeat_timeout_ms": int(self.heartbeat_timeout_seconds * 1000),
        }

    @hookimpl
    def configure_run(self, run: Run) -> None:
        """What is wrong is said before anything is built: the group, the lighthouse, torchft itself."""
        self._group()
        self._lighthouse()
        replicas = run.config.distributed.dp_replicate
        if replicas > 1:  # a group started by hand with the job's HSDP layout
            raise UserError(
                f"plugins.torchft: distributed.dp_replicate = {replicas} in a replica group: "
                "the groups are HSDP's replicate dimension, each one replica; start each group with "
                "--set distributed.dp_replicate=1 --set distributed.strategy='\"fsdp\"' (coretrain run "
                "--nproc-per-node does)"
            )
        try:
            import torchft  # noqa: F401
        except ImportError as exc:
            raise UserError(
                f"plugins.torchft: torchft is not installed ({exc}); pip install 'coretrain-plugins[torchft]'"
            ) from None

    @hookimpl
    def configure_datasets(self, run: Run) -> None:
        """This group's share of the train split: every ``replica_groups``-th sample from its own."""
        train = run.datasets.train
        if is_stream(train):
            raise UserError(
                "plugins.torchft: the train split is a stream; replica groups need a map-style dataset "
                "(each reads every replica_groups-th sample)"
            )
        run.datasets.train = GroupShare(train, self._group(), self.replica_groups)

    @hookimpl(tryfirst=True)
    def on_train_start(self, run: Run) -> None:
        """Join the quorum; a group that starts behind the others takes a live group's state here,
        before the loop plans its first step (and before other plugins' on_train_start look at it)."""
        self._run = run
        group = self._number = self._group()
        self._manager, self._pg, self._store = connect(
            run,
            group,
            self._lighthouse(),
            timeout_seconds=self.timeout_seconds,
            quorum_timeout_seconds=self.quorum_timeout_seconds,
            min_replicas=self.min_replicas,
            state_dict=self._state,
            load_state_dict=self._load_state,
        )
        if self.mode != "ddp":
            self._start_periodic(run)
        self._count_steps(run)
        started = time.perf_counter()
        self._start_quorum(run, say=False)
        if self._received_bytes is None:  # the job starting or resuming: every group takes part from the start
            self._wait_for_every_group(run, resuming=run.state.step > 0)
        if run.dist.is_main:
            self._say_changes(run, {}, self._marks)
        self._begun = run.state.step + 1  # (a state received moved the run to the live groups' step)
        self._synced = run.state.step
        if self._periodic is not None and self._received_bytes is not None:  # met the live groups at a sync
            self._average_until_committed(run, run.state.step)
        if self._received_bytes is not None:
            seconds, megabytes = time.perf_counter() - started, self._received_bytes / 2**20
            sources = [g for g in self._members if g != group]
            source = f"replica group {sources[0]}" if len(sources) == 1 else f"a live replica group ({sources})"
            log.info(
                "replica group %d joined at step %d, state from %s (%.1f MB in %.1f s)",
                group,
                run.state.step + 1,
                source,
                megabytes,
                seconds,
            )

    def _start_periodic(self, run: Run) -> None:
        """torchft's LocalSGD or DiLoCo, made before the first quorum: DiLoCo registers its state (the
        last sync's weights, the outer optimizer) with the manager, for a group that heals."""
        outer = {"lr": self.outer_lr, "momentum": self.outer_momentum, "nesterov": self.outer_nesterov}
        self._periodic = PeriodicSync(self.mode, self._manager, run.unwrapped_model, run.optimizer, **outer)
        if self._resumed:
            self._periodic.load_state_dict(self._resumed)

    def _count_steps(self, run: Run) -> None:
        """torchft heals the groups whose manager is at a lower step than the quorum's highest: the
        run's step, not the steps this process committed (a group resumed from an older checkpoint
        is behind); in localsgd and diloco it counts syncs, so it is set again before each."""
        self._manager.load_state_dict({"step": run.state.step, "batches_committed": 0})

    def _wait_for_every_group(self, run: Run, resuming: bool) -> None:
        """Quorums until every group is in one, or one is ahead and this group took its state. A
        resumed job whose missing groups do not come within the quorum timeout trains on without them."""
        deadline = time.monotonic() + self.quorum_timeout_seconds
        while len(self._members) < self.replica_groups and self._received_bytes is None:
            if time.monotonic() > deadline and resuming:
                log.warning(
                    "torchft: %d of %d replica groups resumed within quorum_timeout_seconds (%g); training on "
                    "without the others (they join when they start)",
                    len(self._members),
                    self.replica_groups,
                    self.quorum_timeout_seconds,
                )
                return
            if time.monotonic() > deadline:
                raise UserError(
                    f"plugins.torchft: {len(self._members)} of {self.replica_groups} replica groups started within "
                    f"quorum_timeout_seconds ({self.quorum_timeout_seconds:g}); start the others, or set replica_groups"
                )
            time.sleep(0.1)
            self._start_quorum(run, say=False)

    # ------------------------------------------------------------------ each step

    def _start_quorum(self, run: Run, say: bool = True) -> None:
        """The next step's quorum, and who is in it (said when it changes)."""
        manager = self._manager
        manager.start_quorum()
        quorum = getattr(manager, "_quorum_id", None)
        if quorum == self._quorum and self._members:
            return
        self._quorum = quorum
        present = torch.zeros(self.replica_groups)
        present[self._number] = self._mark
        manager.allreduce(present, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        marks = {group: mark for group, mark in enumerate(present.tolist()) if mark > 0}
        if not marks:  # the exchange failed with the quorum: the commit will say so, the step runs again
            return
        if say and run.dist.is_main:
            self._say_changes(run, self._marks, marks)
        self._marks = marks

    @property
    def _members(self) -> tuple[int, ...]:
        """The groups of the last quorum."""
        return tuple(self._marks)

    def _say_changes(self, run: Run, before: dict[int, float], now: dict[int, float]) -> None:
        """Groups that left, joined, or were restarted between two quorums (each group keyed to its mark)."""
        step = run.state.step + 1  # (after a state received: the live groups' next step)
        if not before:
            log.info("replica groups %d of %d at step %d", len(now), self.replica_groups, step)
            return
        for g in sorted(set(before) - set(now)):
            self._left_at[g] = step
            log.warning("replica group %d left the quorum at step %d (its share of each step is not read)", g, step)
        for g in sorted(set(now) - set(before)):
            away = step - self._left_at.pop(g, step)
            said = (
                f" (its share of {away} step(s), {away * run.global_batch_size} samples, was not read)" if away else ""
            )
            log.info("replica group %d joined the quorum at step %d%s", g, step, said)
        for g in sorted(set(before) & set(now)):
            if before[g] != now[g]:  # it left and came back between two quorums: no quorum was without it
                log.warning("replica group %d was restarted: it left and rejoined the quorum at step %d", g, step)

    @hookimpl(tryfirst=True)  # the quorum first: what other plugins do in pre_step happens inside the step
    def pre_step(self, run: Run, step: int) -> None:
        if step == self._begun:  # on_train_start began this step's quorum
            self._begun = None
            return
        if self._periodic is None:
            self._start_quorum(run)
        elif (step - 1) % self.sync_every == 0:  # (each group trains on its own between syncs)
            self._sync(run, step - 1)

    @hookimpl(trylast=True)  # after the plugins that stop the run from their post_step
    def post_step(self, run: Run, step: int) -> None:
        if self._periodic is not None:
            if step == run.train_iters:  # the groups end with the same weights
                self._sync(run, step)
        elif self._averaged != step:  # the step was skipped whole here (a pre_step veto): no before_update
            self._average_and_commit(run, vetoed=True, rerun=False, skipped_whole=True)  # ran; the others wait
        self._agree_on_stop(run, step)

    def _sync(self, run: Run, step: int) -> None:
        """localsgd, diloco: the groups meet in a quorum at the boundary after ``step`` — before the
        next step, where a group coming back joins (from ``on_train_start``) with the state of the
        end of ``step`` — and average; and after the run's last step."""
        self._count_steps(run)
        self._start_quorum(run)
        self._average_until_committed(run, step)

    def _average_until_committed(self, run: Run, step: int) -> None:
        """The sync of ``step`` under the quorum just started, again under a new one while a group
        fails in it (as a step runs again in ``ddp``)."""
        assert self._periodic is not None
        while not self._periodic.average():
            log.warning("torchft: the sync of step %d was not committed by every replica group; it runs again", step)
            self._count_steps(run)
            self._start_quorum(run)
        self._missed += (self.replica_groups - len(self._members)) * (step - self._synced)
        self._synced = step

    def _agree_on_stop(self, run: Run, step: int) -> None:
        """A stop one group's plugins asked for (a guard, early stopping) is every group's, at the
        same step. (A signal stays the group's own: a group preempted leaves, the others carry on.)"""
        if not self.agree_stops:
            return
        control = run.control
        own = [float(control.stop_reason is not None), float(control.exit_code), float(control.checkpoint_requested)]
        rows = torch.zeros(self.replica_groups, 3)
        rows[self._number] = torch.tensor(own)
        if not self._exchange(rows):
            return
        asking = [g for g in range(self.replica_groups) if rows[g, 0] > 0 and g != self._number]
        if asking and control.stop_reason is None:
            reason = f"replica group {asking[0]} stopped the run at step {step} (its log says why)"
            checkpoint = bool(rows[asking, 2].max() > 0)
            control.request_stop(reason, checkpoint=checkpoint, exit_code=int(rows[asking, 1].max()))
            if run.dist.is_main:
                log.info("torchft: %s", reason)

    def _exchange(self, values: torch.Tensor) -> bool:
        """``values`` summed over the quorum's groups, in place; False when a group failed in it (the
        step's commit fails too, and the step runs again)."""
        self._manager.allreduce(values, reduce_op=torch.distributed.ReduceOp.SUM).wait()
        return self._manager.errored() is None

    @hookimpl(trylast=True)  # after the plugins that veto: their vetoes travel with the gradients
    def before_update(self, run: Run, step: int) -> None:
        """The gradients averaged over the quorum's groups, and each group's veto or rerun made
        every group's (replicas must take the same updates); the update only if every group of
        the quorum got here."""
        if self._periodic is not None:  # (each group updates on its own; a veto is the group's)
            return
        self._averaged = step
        control = run.control
        agreed = self._average_and_commit(run, control.skip_reason is not None, control.rerun)
        if agreed is not None:
            agree_on_vetoes(control, *agreed)
            return
        log.warning("torchft: step %d was not committed by every replica group of its quorum; it runs again", step)
        self._start_quorum(run)
        control.skip_update("the replica groups' quorum changed during the step", rerun=True)

    def _average_and_commit(
        self, run: Run, vetoed: bool, rerun: bool, skipped_whole: bool = False
    ) -> tuple[float, float] | None:
        """:func:`~coretrain_torchft.ddp.average_and_commit`, counting the shares a committed step missed."""
        agreed = average_and_commit(self._manager, run, vetoed, rerun, take=not skipped_whole)
        if agreed is not None:
            self._missed += self.replica_groups - len(self._members)
        return agreed

    @hookimpl(wrapper=True)  # the figures before the other plugins log them; a stop they ask for after
    def on_log(self, run: Run, step: int, metrics: dict[str, float]) -> Generator[None, None, None]:
        metrics["replica_groups"] = float(len(self._members))
        metrics["replica_group_steps_missed"] = float(self._missed)  # steps x groups whose share went unread
        yield
        self._agree_on_stop(run, step)
        return None

    @hookimpl(trylast=True)  # after the plugins that stop the run from an evaluation (early stopping)
    def on_eval(self, run: Run, step: int) -> None:
        self._agree_on_stop(run, step)

    @hookimpl
    def on_checkpoint(self) -> dict[str, Any] | None:
        """diloco: the weights of the last sync and the outer optimizer, so that a resume goes on exactly."""
        return self._periodic.state_dict() if self._periodic is not None else None

    @hookimpl
    def on_resume(self, state: dict[str, Any]) -> None:
        self._resumed = state  # (applied when training starts and the DiLoCo exists)

    @hookimpl
    def on_train_end(self, run: Run, outcome: Outcome) -> None:
        if outcome == "completed" and self._manager is not None and run.dist.is_main:
            # the groups in the last quorum: coretrain's launcher ends the others (frozen) once this one completed
            ended = {"step": run.state.step, "members": list(self._members)}
            (run.output_dir / ENDED_FILE).write_text(json.dumps(ended))
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None

    # ------------------------------------------------------------------ the state a recovering group takes

    def _state(self) -> dict[str, Any]:
        assert self._run is not None
        return run_state(self._run)

    def _load_state(self, state: dict[str, Any]) -> None:
        assert self._run is not None
        self._received_bytes = float(tensor_bytes(state))
        apply_run_state(self._run, state)
