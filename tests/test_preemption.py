"""A job-wide stop signal (SLURM's ``scancel``, a container stop, a node drain, Ctrl-C in a
terminal) reaches every process of the job's process group, DataLoader workers included.

The run must still checkpoint the step it reached, exit 128+signum and resume exactly: with no
workers, with workers, with persistent evaluation workers, on map-style data and on streams —
with dropout in the model and random augmentation in the workers, so every random stream counts.
Every run is a real ``coretrain run`` in its own process group, signalled with ``killpg``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import metrics_rows, run_here
from test_launcher import children
from test_workloads import TESTS, digits_config

pytestmark = pytest.mark.slow  # real process groups, signals and restarts of CLI runs

TRAIN_ITERS = 60
CASES = {  # name: (provider, [data] keys, [data.options] keys, more train keys)
    "map-no-workers": ("workloads:digits", "num_workers = 0", "augment = true", {}),
    "map-workers": ("workloads:digits", "num_workers = 2", "augment = true", {}),
    "map-persistent-eval-workers": (
        "workloads:digits",
        "num_workers = 2\npersistent_workers = true",
        "augment = true",
        {"eval_interval": 10, "eval_full": False, "eval_iters": 1},
    ),
    "stream-workers": ("workloads:digit_stream", "num_workers = 2", "stateful = true", {}),
}


def case_config(directory: Path, case: str, name: str) -> tuple[Path, Path]:
    provider, data, options, train = CASES[case]
    return digits_config(
        directory,
        name,
        provider=provider,
        data=data,
        options=f"{options}\ndelay = 0.002",  # a slow reader: the signal lands mid-run
        extra="[model.options]\ndropout = 0.1\n[checkpoint]\nsave_interval = 10\n",
        train_iters=TRAIN_ITERS,
        log_interval=1,
        **{"eval_full": False, "eval_iters": 0, **train},
    )


def train_losses(out: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in metrics_rows(out) if "loss" in row]


class References(dict):  # type: ignore[type-arg]
    """Each case's uninterrupted run, made when a test first asks for it: case -> its losses."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.factory = factory
        self.directories: dict[str, Path] = {}
        """case -> its output dir, for its checkpoints."""

    def __missing__(self, case: str) -> list[tuple[int, float]]:
        config, out = case_config(self.factory.mktemp(case), case, "whole")
        result = run_here("run", str(config), cwd=config.parent, env={"PYTHONPATH": TESTS})
        assert result.returncode == 0, result.stderr
        self[case], self.directories[case] = train_losses(out), out
        return self[case]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    return References(tmp_path_factory)


def final_rng(out: Path) -> dict[str, object]:
    """The random streams the last checkpoint saved (python, numpy, torch)."""
    rank_file = out / "checkpoints" / f"step_{TRAIN_ITERS:08d}" / "rank_00000.pt"
    return torch.load(rank_file, weights_only=True)["rng"]


def assert_same_rng(out: Path, reference: Path) -> None:
    ours, theirs = final_rng(out), final_rng(reference)
    assert torch.equal(ours["torch"], theirs["torch"])
    assert ours["python"] == theirs["python"]
    assert torch.equal(ours["numpy"][1], theirs["numpy"][1]) and ours["numpy"][2] == theirs["numpy"][2]


def start_in_own_group(config: Path) -> subprocess.Popen[str]:
    """``coretrain run CONFIG`` in a process group of its own, as a batch job's is."""
    return subprocess.Popen(
        [sys.executable, "-m", "coretrain", "run", str(config)],
        cwd=config.parent,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": TESTS},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_step(out: Path, step: int, process: subprocess.Popen[str], timeout: float = 120) -> None:
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        if any(json.loads(line)["step"] >= step for line in lines if line.endswith("}")):
            return
        time.sleep(0.01)
    raise AssertionError(f"run never reached step {step}")


@pytest.mark.parametrize("case", list(CASES))
def test_a_sigterm_to_the_whole_process_group_checkpoints_and_resumes_exactly(
    tmp_path: Path, case: str, references: References
) -> None:
    config, out = case_config(tmp_path, case, "stopped")
    process = start_in_own_group(config)
    wait_for_step(out, 12, process)
    if "workers" in case and "no-workers" not in case:
        assert len(children(process.pid)) >= 2, "the DataLoader workers should be running"
    os.killpg(process.pid, signal.SIGTERM)  # every process of the job: main and workers
    _, stderr = process.communicate(timeout=120)

    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "killed by signal" not in stderr and "error" not in stderr, stderr
    stopped_at = int((out / "checkpoints" / "latest").read_text())
    assert 12 <= stopped_at < TRAIN_ITERS
    assert f"stopping at step {stopped_at}: received SIGTERM" in stderr
    assert (out / "checkpoints" / f"step_{stopped_at:08d}" / "model.pt").is_file()

    resumed = run_here("run", str(config), cwd=tmp_path, env={"PYTHONPATH": TESTS})
    assert resumed.returncode == 0, resumed.stderr
    assert f"(step {stopped_at}," in resumed.stderr
    assert train_losses(out) == references[case]  # every step's loss, bit for bit
    assert_same_rng(out, references.directories[case])


@pytest.mark.parametrize("stop", ["exit_interval", "sigkill"])
def test_with_workers_a_run_ended_by_exit_interval_or_sigkill_resumes_exactly(
    tmp_path: Path, stop: str, references: References
) -> None:
    """DataLoader workers, dropout and augmentation in the workers: the resumed run's losses and
    the random state it saves are the uninterrupted run's (a loader drawing its workers' seed
    from the global generator made every resume diverge at its first step)."""
    config, out = case_config(tmp_path, "map-workers", "stopped")
    if stop == "exit_interval":
        first = run_here("run", str(config), "--set", "train.exit_interval=12", cwd=tmp_path, env={"PYTHONPATH": TESTS})
        assert first.returncode == 0, first.stderr
        resumed_from = 12
    else:
        process = start_in_own_group(config)
        wait_for_step(out, 23, process)
        os.killpg(process.pid, signal.SIGKILL)  # no handler runs: the last periodic save is what is left
        process.communicate(timeout=60)
        resumed_from = int((out / "checkpoints" / "latest").read_text())
        assert resumed_from >= 20
    resumed = run_here("run", str(config), cwd=tmp_path, env={"PYTHONPATH": TESTS})
    assert resumed.returncode == 0, resumed.stderr
    assert f"(step {resumed_from}," in resumed.stderr
    assert train_losses(out) == references["map-workers"]
    assert_same_rng(out, references.directories["map-workers"])
