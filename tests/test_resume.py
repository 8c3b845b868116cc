"""Interrupted runs resume exactly: SIGTERM, SIGKILL at points of a save, exit_interval.

Every run here is a real `coretrain run` subprocess. "Exactly" is Composer's standard: every
logged loss and the final weights are bit-for-bit those of the uninterrupted run on CPU.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import metrics_rows, run_cli, run_here, start_cli, tiny_gpt_config

pytestmark = pytest.mark.slow  # real signals and restarts of CLI runs: the full suite, not the fast tier

TRAIN_ITERS = 300


def write_config(directory: Path, extra: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "c.toml"
    text = tiny_gpt_config(directory / "out", train_iters=TRAIN_ITERS, log_interval=5, eval_iters=0)
    text = text.replace("n_embd = 32", "n_embd = 32\ndropout = 0.1")  # RNG state matters
    path.write_text(text + "\n[checkpoint]\nsave_interval = 10\n" + extra)
    return path


def losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in metrics_rows(out)]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoints" / f"step_{TRAIN_ITERS:08d}" / "model.pt", weights_only=True)


def assert_same_run(out: Path, reference: Path) -> None:
    assert losses(out) == losses(reference)  # every logged loss, exactly
    ours, theirs = final_weights(out), final_weights(reference)
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)  # atol = rtol = 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run."""
    directory = tmp_path_factory.mktemp("reference")
    result = run_here("run", str(write_config(directory)), cwd=directory)
    assert result.returncode == 0, result.stderr
    return directory / "out"


def wait_for_step(out: Path, step: int, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and process.poll() is None:
        if metrics.exists() and any(
            json.loads(line)["step"] >= step for line in metrics.read_text().splitlines() if line.endswith("}")
        ):  # not a line being written
            return
        time.sleep(0.01)
    raise AssertionError(f"run never reached step {step}")


def test_sigterm_checkpoints_the_step_reached_exits_143_and_resumes_exactly(tmp_path: Path, reference: Path) -> None:
    config = write_config(tmp_path)
    out = tmp_path / "out"
    process = start_cli("run", str(config), cwd=tmp_path)
    wait_for_step(out, 23, process)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr
    stopped_at = int((out / "checkpoints" / "latest").read_text())
    assert 23 <= stopped_at < TRAIN_ITERS
    assert f"stopping at step {stopped_at}: received SIGTERM" in stderr
    assert (out / "checkpoints" / f"step_{stopped_at:08d}" / "model.pt").is_file()
    assert "signal at step" in stdout  # progress saw on_train_end

    resumed = run_here("run", str(config), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped_at:08d}'}" in resumed.stderr
    assert_same_run(out, reference)


@pytest.mark.parametrize(
    ("point", "complete_before_restart"),
    [
        ("before_write", [10]),  # killed as the save of step 20 began
        ("mid_write", [10]),  # killed while writing step 20: its .tmp dir is never loaded
        ("after_commit", [10, 20]),  # killed right after step 20 was committed
    ],
)
def test_sigkill_during_a_save_resumes_from_the_last_complete_checkpoint(
    tmp_path: Path, reference: Path, site: Path, point: str, complete_before_restart: list[int]
) -> None:
    config = write_config(tmp_path, f'\n[plugins.kill-during-save]\nat_step = 20\npoint = "{point}"\n')
    out, env = tmp_path / "out", {"PYTHONPATH": str(site)}
    killed = run_cli("run", str(config), cwd=tmp_path, env=env)
    assert killed.returncode == -signal.SIGKILL
    steps = sorted(int(p.name[5:13]) for p in (out / "checkpoints").glob("step_????????"))
    assert steps == complete_before_restart
    assert (out / "checkpoints" / "step_00000020.tmp").exists() == (point == "mid_write")

    restarted = run_here("run", str(config), "--set", "plugins.kill-during-save.enabled=false", cwd=tmp_path, env=env)
    assert restarted.returncode == 0, restarted.stderr
    assert f"(step {complete_before_restart[-1]}," in restarted.stderr
    if point == "mid_write":
        assert "ignoring incomplete checkpoint" in restarted.stderr and "step_00000020.tmp" in restarted.stderr
    assert_same_run(out, reference)


def test_exit_interval_then_rerun_resumes_exactly(tmp_path: Path, reference: Path) -> None:
    config = write_config(tmp_path)
    first = run_here("run", str(config), "--set", "train.exit_interval=37", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "out" / "checkpoints" / "latest").read_text().strip() == "37"  # mid log interval
    assert run_here("run", str(config), cwd=tmp_path).returncode == 0
    assert_same_run(tmp_path / "out", reference)


def test_async_save_resumes_exactly_too(tmp_path: Path, reference: Path) -> None:
    config = write_config(tmp_path)
    first = run_here(
        "run", str(config), "--set", "train.exit_interval=55", "--set", "checkpoint.async_save=true", cwd=tmp_path
    )
    assert first.returncode == 0, first.stderr
    assert "training blocked" in first.stderr and "writing in the background" in first.stderr
    second = run_here("run", str(config), "--set", "checkpoint.async_save=true", cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert_same_run(tmp_path / "out", reference)


def test_a_repeated_sigterm_or_sigusr1_waits_but_a_second_ctrl_c_aborts_at_once() -> None:
    code = (
        "import os, signal, time\nfrom coretrain.signals import SignalWatcher\n"
        "with SignalWatcher() as watcher:\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"  # torchrun forwarding the scheduler's signal
        "    os.kill(os.getpid(), signal.SIGUSR1)\n"
        "    time.sleep(0.1)\n"
        "    assert watcher.received == signal.SIGTERM\n"
        "    print('survived repeats', flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"  # a person pressing Ctrl-C again
        "    time.sleep(5)\n"
        "print('survived ctrl-c')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGINT and "survived repeats" in result.stdout
    assert "survived ctrl-c" not in result.stdout


def test_after_the_run_ctrl_c_is_a_keyboard_interrupt_again_not_the_start_up_exit() -> None:
    """``python -m coretrain`` installs a start-up handler that exits at once; the run's watcher
    replaces it, and gives back Python's own handler, not that one, when the run is over."""
    import signal

    from coretrain.signals import SignalWatcher

    def start_up(signum: int, frame: object) -> None:  # what coretrain.__main__ installs
        raise AssertionError("the start-up handler must not come back")

    start_up.coretrain_start_up = True  # type: ignore[attr-defined]
    before = signal.signal(signal.SIGINT, start_up)
    try:
        with SignalWatcher():
            assert signal.getsignal(signal.SIGINT) is not start_up
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
