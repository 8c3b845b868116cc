"""A job-wide stop signal (SLURM's ``scancel``, a container stop, a node drain, Ctrl-C in a
terminal) reaches every process of the job's process group, DataLoader workers included.

The run must still checkpoint the step it reached, exit 128+signum and resume exactly: with no
workers, with workers, with persistent evaluation workers, on map-style data and on streams.
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
from conftest import metrics_rows, run_cli
from test_launcher import children
from test_workloads import TESTS, digits_config

pytestmark = pytest.mark.slow  # real process groups, signals and restarts of CLI runs

TRAIN_ITERS = 60
CASES = {  # name: (provider, [data] keys, [data.options] keys, more train keys)
    "map-no-workers": ("workloads:digits", "num_workers = 0", "", {}),
    "map-workers": ("workloads:digits", "num_workers = 2", "", {}),
    "map-persistent-eval-workers": (
        "workloads:digits",
        "num_workers = 2\npersistent_workers = true",
        "",
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
        train_iters=TRAIN_ITERS,
        log_interval=1,
        **{"eval_full": False, "eval_iters": 0, **train},
    )


def train_losses(out: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in metrics_rows(out) if "loss" in row]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[int, float]]]:
    """Each case's uninterrupted run, made when a test first asks for it."""
    made: dict[str, list[tuple[int, float]]] = {}

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, case: str) -> list[tuple[int, float]]:
            config, out = case_config(tmp_path_factory.mktemp(case), case, "whole")
            result = run_cli("run", str(config), cwd=config.parent, env={"PYTHONPATH": TESTS})
            assert result.returncode == 0, result.stderr
            self[case] = train_losses(out)
            return self[case]

    return Lazy(made)


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
    tmp_path: Path, case: str, references: dict[str, list[tuple[int, float]]]
) -> None:
    config, out = case_config(tmp_path, case, "stopped")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": TESTS}
    process = subprocess.Popen(
        [sys.executable, "-m", "coretrain", "run", str(config)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a batch job's is
    )
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

    resumed = run_cli("run", str(config), cwd=tmp_path, env={"PYTHONPATH": TESTS})
    assert resumed.returncode == 0, resumed.stderr
    assert f"(step {stopped_at}," in resumed.stderr
    assert train_losses(out) == references[case]  # every step's loss, bit for bit
