"""``coretrain run --nnodes MIN:MAX --rdzv-endpoint H:P --replace-failed-ranks``: a machine that
joins or leaves changes the job in-process — the running ranks stay the same processes — and the
losses are those of a job restarted from the same checkpoint on the new size. Two launchers on
this machine play two machines, as in test_launcher's elastic test."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest
from conftest import in_one_job, metrics_rows, run_train
from test_launcher import children, free_port, wait_for

from coretrain.testing import tiny_config, write_config

SLOW_STEPS = {"action": "sleep", "step": 1, "every_step": True, "sleep_seconds": 0.1}


def config(tmp_path: Path, name: str, plugins: Mapping[str, object] | None = None, steps: int = 150) -> Path:
    sections = tiny_config(
        tmp_path / name,
        train={"train_iters": steps, "log_interval": 1, "micro_batch_size": 4, "global_batch_size": 8},
        checkpoint={"save_interval": 5},
        distributed={"backend": "gloo"},
        plugins=plugins or {},
    )
    return write_config(tmp_path / f"{name}.toml", sections)


class Machines:
    """Launchers on this machine, each playing one machine of a job (one rank each): the same
    command, with its output in NAME.log."""

    def __init__(self, tmp_path: Path, toml: Path, nnodes: str, *more: str) -> None:
        self.tmp_path, self.port, self.started = tmp_path, free_port(), list[subprocess.Popen[bytes]]()
        self.command = [sys.executable, "-m", "coretrain", "run", str(toml), "--nnodes", nnodes, "--nproc-per-node"]
        self.command += ["1", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--replace-failed-ranks", *more]

    def start(self, name: str, *more: str, **env_vars: str) -> subprocess.Popen[bytes]:
        env, command = dict(os.environ, OMP_NUM_THREADS="1", **env_vars), [*self.command, *more]
        with open(self.tmp_path / f"{name}.log", "wb") as log:
            self.started.append(subprocess.Popen(command, cwd=self.tmp_path, env=env, stdout=log, stderr=log))
        return self.started[-1]

    def said(self, name: str = "a") -> str:
        return (self.tmp_path / f"{name}.log").read_text()

    def kill(self) -> None:
        for launcher in self.started:
            if launcher.poll() is None:
                launcher.kill()


def listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def losses_by_step(out: Path) -> dict[int, float]:
    if not (out / "metrics.jsonl").exists():
        return {}
    return {int(row["step"]): row["loss"] for row in metrics_rows(out) if "loss" in row}


def resumed_from(out: Path, step: int, into: str, *args: str) -> dict[int, float]:
    """The losses of a job started from ``out``'s checkpoint of ``step`` with ``args``."""
    target = out.parent / into
    shutil.copytree(out / "checkpoints" / f"step_{step:08d}", target / "checkpoints" / f"step_{step:08d}")
    toml = config(out.parent, into)
    job = run_train(str(toml), *args, cwd=out.parent, env={"OMP_NUM_THREADS": "1"})
    assert job.returncode == 0, job.stderr[-3000:]
    return losses_by_step(target)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a launcher's death reaches its ranks on Linux")
def test_a_machine_joins_and_leaves_and_the_first_machines_rank_trains_on_in_the_same_process(tmp_path: Path) -> None:
    """Machine A starts alone (--nnodes 1:2); B comes: A's rank stops with a checkpoint and forms
    a group of 2 with B's rank in-process. Then B's launcher is SIGKILLed: its rank dies with it,
    A's leader drops B's rank when its heartbeat stops, and A's rank goes on alone, in-process.
    A's rank is one process throughout; each stretch's losses equal a job restarted from the
    same checkpoint on that size. Each machine has a local_dir of its own, so the local tier's
    copies between machines run through both changes (durable checkpoints at every step, where
    a resume prefers them, so the references can start from them)."""
    # 0.2 s steps: B's launcher and rank, started under load at step 10, must be taken in, train
    # 10 steps and be missed for 3 s before A's job ends at step 150 (28 s; at 0.1 s a loaded
    # machine left too little of the job for that)
    slower = {**SLOW_STEPS, "sleep_seconds": 0.2}
    plugins = {"inprocess-restart": {}, "fault-injection": slower, "local-checkpoint": {}}
    toml, out = config(tmp_path, "job", plugins), tmp_path / "job"
    machines = Machines(
        tmp_path, toml, "1:2", "--rdzv-conf", "last_call_timeout=1", "--set", "checkpoint.save_interval=1"
    )
    said = machines.said

    def start(name: str) -> subprocess.Popen[bytes]:
        return machines.start(name, "--set", f"plugins.local-checkpoint.local_dir={tmp_path / name / 'shm'}")

    a = start("a")
    try:
        wait_for(lambda: max(losses_by_step(out), default=0) >= 10 and len(children(a.pid)) == 1, "A training")
        (rank_of_a,) = children(a.pid)
        b = start("b")
        wait_for(lambda: "in-process re-form: resumed at step" in said(), "B's rank to be taken in")
        joined = int(re.findall(r"stopping at step (\d+): ranks wait to join", said())[0])
        wait_for(lambda: max(losses_by_step(out)) >= joined + 10, "the job to train on 2 ranks")
        b.send_signal(signal.SIGKILL)  # the launcher alone: its rank dies with it
        wait_for(lambda: "in-process restart 1: resumed at step" in said(), "A's rank to go on alone")
        assert children(a.pid) == [rank_of_a]  # the same process, through both changes
        assert a.wait(timeout=240) == 0, said()[-3000:]
    finally:
        machines.kill()
    log = said()
    assert "machine 1 joined" in log and "in-process re-form: 1 rank(s) joined; 2 ranks go on (was 1)" in log
    assert "machine 1 left (no heartbeat for 3 s): the other ranks go on without its ranks" in log
    assert "1 of 2 ranks go on (the launcher runs no more)" in log
    left = int(re.findall(r"in-process restart 1: resumed at step (\d+)", log)[0])
    assert joined < left < 150
    assert "received SIGTERM" not in log
    job = losses_by_step(out)
    assert sorted(job) == list(range(1, 151))
    on_two = resumed_from(out, joined, "two", "--nproc-per-node", "2", "--set", f"train.exit_interval={left}")
    assert [job[step] for step in range(joined + 1, left + 1)] == [on_two[s] for s in range(joined + 1, left + 1)]
    on_one = resumed_from(out, left, "one")
    assert [job[step] for step in range(left + 1, 151)] == [on_one[s] for s in range(left + 1, 151)]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a launcher's death reaches its ranks on Linux")
def test_a_machine_that_comes_takes_the_place_of_one_that_left_a_job_at_its_minimum(tmp_path: Path) -> None:
    """--nnodes 2: A and B start, each with its own local_dir (as /dev/shm is a machine's own),
    durable checkpoints only at the end; B's launcher is SIGKILLed, which leaves fewer than 2
    machines; A's rank waits in-process. C comes with an empty local_dir: its rank takes rank 1's
    place, gets the newest local checkpoint from A's copy (which holds B's rank's file too), and
    joins A's restart as a replaced process does. A's rank is one process throughout, the job
    resumes from the local checkpoint, and the losses are those of an uninterrupted run on 2 ranks."""
    plugins = {"inprocess-restart": {}, "fault-injection": SLOW_STEPS, "local-checkpoint": {}}
    toml, whole, out = config(tmp_path, "job", plugins, 40), config(tmp_path, "whole", steps=40), tmp_path / "job"
    machines = Machines(tmp_path, toml, "2", "--set", "checkpoint.save_interval=100")
    said = machines.said

    def start(name: str) -> subprocess.Popen[bytes]:
        return machines.start(name, "--set", f"plugins.local-checkpoint.local_dir={tmp_path / name / 'shm'}")

    a = start("a")
    try:
        wait_for(lambda: listening(machines.port) or a.poll() is not None, "A to serve the meeting point")
        assert a.poll() is None, said()  # (its machine is the one that stays)
        b = start("b")
        wait_for(lambda: max(losses_by_step(out), default=0) >= 12, "A and B training")
        (rank_of_a,) = children(a.pid)
        b.send_signal(signal.SIGKILL)
        wait_for(lambda: "the ranks wait for a machine to take its place" in said(), "A's leader to miss B")
        c = start("c")
        wait_for(lambda: "resumed at step" in said(), "C's rank to take rank 1's place")
        assert children(a.pid) == [rank_of_a]
        assert a.wait(timeout=240) == 0, said()[-3000:]
        assert c.wait(timeout=60) == 0, said("c")[-3000:]
    finally:
        machines.kill()
    log = said()
    assert "machine 1 left (no heartbeat for 3 s): fewer than 2 machines remain" in log
    assert "machine 2 came: its ranks take the place of machine 1's" in log
    assert "after rank 1 died (machine 1 left); a new process took its place" in log
    # B killed after a local save but before its copy: that step is offered too, and lacks B's rank's file
    ((steps, copied),) = re.findall(r"local checkpoints: step ([\d and]+) on each of 2 machines \(([\d.]+) kB", log)
    resumed = int(re.findall(r"in-process restart 1: resumed at step (\d+)", log)[0])
    assert resumed == int(steps.split()[0]) >= 11 and float(copied) > 0  # the local tier's whole copy
    in_one_job(tmp_path, 2, [["run", str(whole)]], "whole")
    assert losses_by_step(out) == losses_by_step(tmp_path / "whole")


SLOW_TO_JOIN = """
import os, time

if "CORETRAIN_JOINED" in os.environ:  # a joining machine's rank (its launcher sets it): slow to start
    time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a launcher's death reaches its ranks on Linux")
def test_a_machine_that_comes_as_the_job_ends_is_sent_home_not_left_waiting(tmp_path: Path) -> None:
    """B comes near the end of A's job, and its rank is slow to start (60 s, a sitecustomize):
    the job ends before that rank is ready to be taken in. A's leader tells B the job is over: B
    stops its rank and both launchers exit 0 — not after B's rank waits out
    restart_timeout_seconds (300 s here) with A's leader waiting for it."""
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "sitecustomize.py").write_text(SLOW_TO_JOIN)
    # A's last 38 steps take 23 s and more (0.6 s each): B's launcher, started under load, must
    # meet A's before A's job ends (else B finds the port free and leads a job of its own; with
    # 0.3 s steps from step 5, 10 s, a loaded CI machine once started B too late)
    slower = {**SLOW_STEPS, "sleep_seconds": 0.6}
    plugins = {"inprocess-restart": {"restart_timeout_seconds": 300}, "fault-injection": slower}
    toml, out = config(tmp_path, "job", plugins, steps=40), tmp_path / "job"
    machines = Machines(tmp_path, toml, "1:2", "--rdzv-conf", "last_call_timeout=1")
    a = machines.start("a")
    try:
        wait_for(lambda: max(losses_by_step(out), default=0) >= 2, "A training")
        b = machines.start("b", PYTHONPATH=str(tmp_path / "slow"))
        assert b.wait(timeout=120) == 0, machines.said("b")[-3000:]
        assert a.wait(timeout=60) == 0, machines.said()[-3000:]
    finally:
        machines.kill()
    assert "the job ended before this machine's ranks were taken in" in machines.said("b")
    assert "machine 1 joined" in machines.said() and "re-form" not in machines.said()
    assert sorted(losses_by_step(out)) == list(range(1, 41))
