"""``coretrain run --nproc-per-node N --replace-failed-ranks``: a rank's process that dies is
replaced alone — the launcher starts a new process for that rank, the surviving ranks wait for it
in-process and re-form the group with it — and the run's losses are an uninterrupted run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from conftest import in_one_job, run_here, run_train
from test_backends import wait_for_logged_steps
from test_inprocess_restart import config as two_rank_config
from test_inprocess_restart import losses

from coretrain.testing import tiny_config, write_config

ENV = {"OMP_NUM_THREADS": "1"}
REPLACING = ("--nproc-per-node", "2", "--replace-failed-ranks")


@pytest.mark.slow
def test_a_killed_rank_0_is_replaced_while_rank_1_waits_in_process(
    tmp_path: Path, uninterrupted_losses: list[float]
) -> None:
    """The issue's item 2, with the hardest rank to lose (it logs, it locks the output dir; the
    store is the launcher's, so it survives it): SIGKILL at step 8. With one replacement allowed,
    rank 1 cannot have been started again: it re-formed the group in-process with the new rank 0,
    both resumed from the local checkpoint of step 7 (a replacement does not clear the local tier
    as a new job's first process does), and the losses are an uninterrupted run's."""
    fault = {"action": "sigkill", "step": 8, "ranks": [0], "attempt": 0}
    shm = {"local_dir": str(tmp_path / "shm")}
    plugins = {"fault-injection": fault, "inprocess-restart": {}, "local-checkpoint": shm}
    killed = two_rank_config(tmp_path, "killed", **plugins)
    job = run_train(killed, *REPLACING, "--max-restarts", "1", cwd=tmp_path, env=ENV)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "rank 0 ended (SIGKILL); starting a new process in its place (1/1)" in job.stderr
    assert "in-process restart 1/3 after rank 0 died (SIGKILL); a new process took its place" in job.stderr
    assert "in-process restart 1: resumed at step 7, " in job.stderr
    assert losses(tmp_path / "killed") == uninterrupted_losses


@pytest.mark.slow
def test_a_rank_that_dies_again_once_the_replacements_are_spent_ends_the_job(tmp_path: Path) -> None:
    """The fault fires in every process of rank 1: its replacement dies at step 8 again; the job
    ends with the launcher's line and the signal's exit code, the other rank stopped, not hung."""
    plugins = {"fault-injection": {"action": "sigkill", "step": 8, "ranks": [1]}, "inprocess-restart": {}}
    job = run_train(
        two_rank_config(tmp_path, "killed", **plugins), *REPLACING, "--max-restarts", "1", cwd=tmp_path, env=ENV
    )
    assert job.returncode == 128 + 9, job.stderr[-3000:]
    assert job.stderr.count("starting a new process in its place") == 1
    assert "error: rank 1 failed with exit code -9" in job.stderr


@pytest.mark.slow
def test_with_min_ranks_the_others_go_on_without_a_dead_rank_as_a_smaller_job(tmp_path: Path) -> None:
    """The issue's item 5 on one machine: rank 0 is killed at step 8 and no replacement is left;
    with ``--min-ranks 1`` rank 1 goes on in-process as rank 0 of a job of one rank — the
    data-parallel size 1, the global batch of 16 kept by 2 micro-batches — resumed from the local
    checkpoint of step 7, and its losses are those of the same job stopped at step 7 and
    restarted on one rank."""

    def job(name: str, **plugins: Any) -> str:
        train = {"train_iters": 12, "log_interval": 1, "global_batch_size": 16}
        sections = tiny_config(
            tmp_path / name,
            train=train,
            checkpoint={"save_interval": 4},
            distributed={"backend": "gloo"},
            plugins=plugins,
        )
        return str(write_config(tmp_path / f"{name}.toml", sections))

    fault = {"action": "sigkill", "step": 8, "ranks": [0], "attempt": 0}
    shm = {"local_dir": str(tmp_path / "shm")}
    shrunk = job("shrunk", **{"fault-injection": fault, "inprocess-restart": {}, "local-checkpoint": shm})
    done = run_train(shrunk, *REPLACING, "--min-ranks", "1", cwd=tmp_path, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 ended (SIGKILL) and no replacement is left; the other 1 rank(s) go on without it" in done.stderr
    assert "; 1 of 2 ranks go on (the launcher runs no more)" in done.stderr
    assert "global batch 16 (micro 8 × 2 accumulation × 1 data-parallel), 1 rank(s)" in done.stdout + done.stderr
    assert "in-process restart 1: resumed at step 7, " in done.stderr

    reference = job("reference")
    in_one_job(tmp_path, 2, [["run", reference, "--set", "train.exit_interval=7"]], "reference")
    assert run_train(reference, cwd=tmp_path, env=ENV).returncode == 0  # restarted on one rank
    assert losses(tmp_path / "shrunk") == losses(tmp_path / "reference")


@pytest.mark.slow
def test_a_frozen_rank_restarts_the_job_as_torchrun_would(tmp_path: Path, uninterrupted_losses: list[float]) -> None:
    """Rank 1 is stopped (SIGSTOP) at step 6: rank 0's watchdog names it and ends (exit 124). A new
    rank 0 alone would wait for the frozen rank in vain, so the launcher kills it and starts every
    rank again — on a store of its own — and the job completes with the uninterrupted losses."""
    frozen = {"action": "sigstop", "step": 6, "ranks": [1], "attempt": 0}
    plugins = {"fault-injection": frozen, "inprocess-restart": {}, "watchdog": {"step_timeout_seconds": 3.0}}
    stopped = two_rank_config(tmp_path, "stopped", **plugins)
    job = run_train(stopped, *REPLACING, "--max-restarts", "1", cwd=tmp_path, env=ENV)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "rank 0 ended on a hang (exit 124); starting every rank again (1/1)" in job.stderr
    assert "last at step 6, pre_step)" in job.stderr, job.stderr[-3000:]  # heard in the step it froze in
    assert "starting a new process in its place" not in job.stderr
    assert losses(tmp_path / "stopped") == uninterrupted_losses


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_rank_with_a_checkpoint(tmp_path: Path) -> None:
    """The launcher passes SIGTERM on: the ranks agree, save a checkpoint and stop; the job exits
    143, as a single-process run and torchrun's launcher under ``coretrain run`` do."""
    slow = {"action": "sleep", "step": 1, "every_step": True, "sleep_seconds": 0.05}
    sections = tiny_config(
        tmp_path / "out",
        train={"train_iters": 100_000, "log_interval": 1},
        checkpoint={"save_interval": 100_000},
        distributed={"backend": "gloo"},
        plugins={"fault-injection": slow, "inprocess-restart": {}},
    )
    config = write_config(tmp_path / "job.toml", sections)
    command = [sys.executable, "-m", "coretrain", "run", str(config), *REPLACING, "--max-restarts", "1"]
    with open(tmp_path / "job.log", "wb") as log:
        launcher = subprocess.Popen(command, cwd=tmp_path, env={**os.environ, **ENV}, stdout=log, stderr=log)
    try:
        wait_for_logged_steps(tmp_path / "out", 3, launcher)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=120) == 128 + signal.SIGTERM, (tmp_path / "job.log").read_text()[-3000:]
    finally:
        launcher.kill()
    assert [p.name for p in (tmp_path / "out" / "checkpoints").iterdir() if p.name.startswith("step_")]


RESTART = {"inprocess-restart": {}}


@pytest.mark.parametrize(
    ("args", "plugins", "said"),
    [
        ((*REPLACING, "--max-restarts", "1"), {}, "--replace-failed-ranks: the other ranks wait"),
        (REPLACING, RESTART, "--replace-failed-ranks: add --max-restarts K"),
        (
            (*REPLACING, "--max-restarts", "1", "--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "0"),
            RESTART,
            "--replace-failed-ranks: machines are numbered as they come; leave out --node-rank",
        ),
        (
            (*REPLACING, "--max-restarts", "1", "--rdzv-endpoint", "h:1"),
            RESTART,
            "--replace-failed-ranks on one machine: leave out --rdzv-endpoint",
        ),
        ((*REPLACING, "--min-ranks", "3"), RESTART, "--min-ranks 3: expected 1..2 (machines × --nproc-per-node)"),
        (
            (*REPLACING, "--nnodes", "1:2", "--rdzv-endpoint", "h:1", "--min-ranks", "5"),
            RESTART,
            "--min-ranks 5: expected 1..4 (machines × --nproc-per-node)",
        ),
        (("--nproc-per-node", "2", "--min-ranks", "1"), RESTART, "--min-ranks: only with --replace-failed-ranks"),
    ],
)
def test_what_it_needs_is_one_error_before_any_rank_starts(
    tmp_path: Path, args: tuple[str, ...], plugins: dict[str, dict[str, int]], said: str
) -> None:
    job = run_here("run", two_rank_config(tmp_path, "job", **plugins), *args, cwd=tmp_path)
    assert job.returncode == 2
    assert f"error: {said}" in job.stderr, job.stderr


@pytest.mark.slow  # a real process making its directory as a launcher does, SIGKILLed
def test_a_sigkilled_launchers_error_files_go_when_the_next_launcher_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGKILLed launcher removes nothing: the next one on the machine removes the directory of
    its ranks' error files once its process is gone, and never one of a launcher still running."""
    from coretrain_launch.errordir import error_dir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = "from coretrain_launch.errordir import error_dir; print(error_dir(), flush=True); input()"
    launcher = [sys.executable, "-c", code]
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    with subprocess.Popen(launcher, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) as other:
        assert other.stdout is not None
        left = Path(other.stdout.readline().decode().strip())
        (left / "rank0.json").write_text("{}")
        running = error_dir()  # while the other launcher runs: its directory stays
        assert left.parent == tmp_path and (left / "rank0.json").is_file()
        other.kill()
    again = error_dir()
    assert not left.exists() and running.is_dir() and again.is_dir() and again != running
