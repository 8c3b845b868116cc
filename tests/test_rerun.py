"""The ``rerun`` plugin (Megatron's rerun state machine), driven through the CLI with
``fault-injection`` making one step's loss NaN on chosen ranks, once or every time it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import in_one_job, metrics_rows, per_command, run_here

from coretrain.testing import tiny_config, write_config

DROPOUT = {"provider": "coretrain.testing:tiny_model", "options": {"dropout": 0.3}}
"""Dropout draws from the random stream: a rerun that drew other masks would train otherwise."""


def write(tmp_path: Path, name: str, plugins: dict[str, Any], ranks: int = 1, **train: Any) -> Path:
    settings = {"micro_batch_size": 4, "global_batch_size": 4 * ranks, "train_iters": 10, "log_interval": 1}
    sections: dict[str, Any] = {"model": DROPOUT, "train": settings | train, "plugins": plugins}
    if ranks > 1:
        sections["distributed"] = {"backend": "gloo"}
    return write_config(tmp_path / f"{name}.toml", tiny_config(tmp_path / name, **sections))


def losses(out: Path) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in metrics_rows(out) if "loss" in row]


def nan_at(step: int, persistent: bool = False, **more: Any) -> dict[str, Any]:
    return {"action": "nan", "step": step, "persistent": persistent, **more}


def test_a_transient_nan_is_rerun_and_the_run_trains_as_if_it_had_not_happened(tmp_path: Path) -> None:
    clean = run_here("run", str(write(tmp_path, "clean", {})), cwd=tmp_path)
    assert clean.returncode == 0, clean.stderr
    faulty = run_here("run", str(write(tmp_path, "faulty", {"rerun": {}, "fault-injection": nan_at(5)})), cwd=tmp_path)
    assert faulty.returncode == 0, faulty.stderr
    assert "rerun: rank 0, step 5 (samples 16..19): loss is nan; the rerun gave" in faulty.stderr
    assert "a transient fault" in faulty.stderr
    # the same batch, the same dropout masks: every loss bitwise as in the run without the fault
    assert losses(tmp_path / "faulty") == losses(tmp_path / "clean")
    last = [row for row in metrics_rows(tmp_path / "faulty") if "loss" in row][-1]
    assert (last["rerun/reruns"], last["rerun/transient"], last["rerun/persistent"]) == (1, 1, 0)
    assert last["skipped_updates"] == 0


def test_a_persistent_nan_stops_with_a_checkpoint_and_names_the_step_and_its_samples(tmp_path: Path) -> None:
    plugins = {"rerun": {}, "fault-injection": nan_at(5, persistent=True)}
    job = run_here("run", str(write(tmp_path, "run", plugins)), cwd=tmp_path)
    assert job.returncode == 17, job.stderr  # Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    assert (
        "stopping at step 5: rerun: the loss at step 5 (samples 16..19) is bad again on the same batch "
        "and random state: a persistent fault"
    ) in job.stderr
    assert sorted(path.name for path in (tmp_path / "run" / "checkpoints").glob("step_*")) == ["step_00000005"]
    last = metrics_rows(tmp_path / "run")[-1]  # a skipped step logs no loss
    # the NaN gradients never reached the weights
    assert (last["step"], last["skipped_updates"], last["rerun/persistent"]) == (5, 1, 1)


def test_exit_on_transient_saves_and_exits_16_and_the_resumed_run_loses_nothing(tmp_path: Path) -> None:
    assert run_here("run", str(write(tmp_path, "clean", {})), cwd=tmp_path).returncode == 0
    plugins = {"rerun": {"exit_on_transient": True}, "fault-injection": nan_at(5)}
    config = write(tmp_path, "moved", plugins)
    job = run_here("run", str(config), cwd=tmp_path)
    assert job.returncode == 16, job.stderr  # Megatron's EXIT_CODE_RESUME_TO_DISAMBIGUATE
    assert "rerun: a transient fault at step 5 (samples 16..19); exiting so that the job restarts" in job.stderr
    resumed = run_here("run", str(config), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr
    # the rerun's good update was kept before exiting: the two attempts are the uninterrupted run
    assert losses(tmp_path / "moved") == losses(tmp_path / "clean")


def test_determinism_stats_rerun_every_step_and_report_the_spread(tmp_path: Path) -> None:
    assert run_here("run", str(write(tmp_path, "clean", {}, log_interval=5)), cwd=tmp_path).returncode == 0
    stats = {"rerun": {"mode": "report_determinism_stats"}}
    job = run_here("run", str(write(tmp_path, "stats", stats, log_interval=5)), cwd=tmp_path)
    assert job.returncode == 0, job.stderr
    rows = [row for row in metrics_rows(tmp_path / "stats") if "loss" in row]
    assert [row["rerun/reruns"] for row in rows] == [5, 10]
    assert all(row["rerun/max_diff"] == 0.0 == row["rerun/mean_diff"] for row in rows)  # CPU: deterministic
    assert [(row["step"], row["loss"]) for row in rows] == losses(tmp_path / "clean")


def test_a_spike_is_judged_against_the_largest_early_loss_and_a_nan_not_at_all() -> None:
    from coretrain_rerun import Rerun, relative_difference

    watcher = Rerun(check_for_spiky_loss=True, spiky_loss_samples=3, spiky_loss_factor=10)
    assert [watcher._problem(value) for value in (2.0, 5.0, 3.0)] == [None, None, None]
    assert watcher._problem(49.9) is None
    assert watcher._problem(50.0) == "spiky loss 50 (>= 10 × 5)"
    spikes_only = Rerun(check_for_nan_in_loss=False, check_for_spiky_loss=True, spiky_loss_samples=1)
    assert spikes_only._problem(float("nan")) is None
    assert relative_difference(float("nan"), float("nan")) == 0.0  # Megatron's _compare_floats
    assert relative_difference(float("nan"), 1.0) == float("inf")
    assert relative_difference(1.0, 3.0) == 1.0


@pytest.mark.slow  # one job of 2 gloo ranks, three runs
def test_a_nan_on_one_rank_is_rerun_on_both_and_the_verdict_is_agreed(tmp_path: Path) -> None:
    configs = {
        "clean": write(tmp_path, "clean", {}, ranks=2),
        "transient": write(tmp_path, "transient", {"rerun": {}, "fault-injection": nan_at(5, ranks=[1])}, ranks=2),
        "persistent": write(
            tmp_path, "persistent", {"rerun": {}, "fault-injection": nan_at(5, persistent=True, ranks=[1])}, ranks=2
        ),
    }
    runs: list[Any] = [["run", str(configs["clean"])], ["run", str(configs["transient"])]]
    runs.append({"args": ["run", str(configs["persistent"])], "expect": 17})
    job = in_one_job(tmp_path, 2, runs, "rerun", env={"OMP_NUM_THREADS": "1"})
    said = per_command(job.stderr, [str(path) for path in configs.values()])
    transient, persistent = said[str(configs["transient"])], said[str(configs["persistent"])]
    assert "rerun: rank 1, step 5 (samples 32..39): loss is nan; the rerun gave" in transient
    assert losses(tmp_path / "transient") == losses(tmp_path / "clean")  # rank 0 reran too, on its own masks
    # rank 0 saw no NaN, yet stops: the ranks agreed on rank 1's verdict (one step late, as stops are)
    assert "coretrain: stopping at step 6: rerun: the loss at step 5 (samples 32..39) is bad again" in persistent
    assert (tmp_path / "persistent" / "checkpoints" / "step_00000006").is_dir()


def test_guards_name_the_parameter_whose_gradient_is_not_finite(tmp_path: Path) -> None:
    """Megatron's check_for_nan_in_grad, in guards: the loss is finite, one gradient is not."""
    plugins = {
        "guards": {"check_for_nan_in_grad": True, "action": "stop"},
        "fault-injection": {"action": "nan", "step": 4, "parameter": "net.3.weight"},
    }
    job = run_here("run", str(write(tmp_path, "run", plugins)), cwd=tmp_path)
    assert job.returncode == 3, job.stderr
    assert "guards: step 4: the gradient of net.3.weight is not finite (rank 0); stopping" in job.stderr
    unchecked = {"guards": {"action": "stop"}, "fault-injection": plugins["fault-injection"]}
    late = run_here("run", str(write(tmp_path, "unchecked", unchecked)), cwd=tmp_path)
    # unchecked, step 4's NaN gradient went into the weights: the loss is NaN one step later
    assert late.returncode == 3 and "stopping at step 5: guards: loss is nan" in late.stderr
