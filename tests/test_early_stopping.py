"""early-stopping: stop when an evaluated metric stops improving, through the agreed stop path."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from conftest import in_one_job, metrics_rows, tiny_gpt_config

from coretrain import UserError
from coretrain.testing import run_steps

EVAL_EVERY_2 = {"train": {"eval_interval": 2, "eval_iters": 1}, "checkpoint": {"save_interval": 100}}


def test_a_metric_that_stops_improving_stops_the_run_after_patience_evaluations(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No later evaluation beats the first by more than min_delta = 100: evaluations at steps
    2 (the best), 4 and 6 (two without improvement) stop the run after step 6, with a
    checkpoint of step 6, exit 0, outcome "stopped" and the reason in the log."""
    caplog.set_level(logging.INFO, logger="coretrain")
    tables = {"early-stopping": {"patience": 2, "min_delta": 100.0}}
    result = run_steps(tmp_path, 20, tables=tables, config=EVAL_EVERY_2)
    assert result.exit_code == 0
    assert result.run.state.step == 6
    assert [e["step"] for e in result.evals] == [2, 4, 6]
    assert result.hooks("on_train_end") == [6]
    assert result.calls[-1].kwargs["outcome"] == "stopped"
    assert (result.output_dir / "checkpoints" / "step_00000006").is_dir()
    assert "stopping at step 6: early stopping: valid/loss did not improve on" in caplog.text
    assert "in 2 evaluations" in caplog.text


def test_an_improving_metric_trains_to_the_end(tmp_path: Path) -> None:
    result = run_steps(tmp_path, 12, tables={"early-stopping": {"patience": 1}}, config=EVAL_EVERY_2)
    losses = [e["valid/loss"] for e in result.evals]
    assert losses == sorted(losses, reverse=True)  # it did improve every time, so nothing stopped it
    assert result.run.state.step == 12 and result.calls[-1].kwargs["outcome"] == "completed"


def test_mode_max_watches_a_metric_that_should_grow(tmp_path: Path) -> None:
    """The tiny loss falls, so "max" on it sees no improvement after the first evaluation."""
    tables = {"early-stopping": {"patience": 1, "mode": "max"}}
    result = run_steps(tmp_path, 20, tables=tables, config=EVAL_EVERY_2)
    assert result.run.state.step == 4


def test_a_resumed_run_keeps_counting_and_a_stopped_run_stays_stopped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Interrupted after one evaluation without improvement, the resumed run stops one
    evaluation later (step 6, not 8); resubmitted after the stop, it trains no step."""
    caplog.set_level(logging.INFO, logger="coretrain")
    tables = {"early-stopping": {"patience": 2, "min_delta": 100.0}}
    interrupted = {**EVAL_EVERY_2, "train": {**EVAL_EVERY_2["train"], "exit_interval": 4}}
    first = run_steps(tmp_path, 20, tables=tables, config=interrupted)
    assert first.run.state.step == 4
    resumed = run_steps(tmp_path, 20, tables=tables, config=EVAL_EVERY_2)
    assert resumed.run.state.step == 6 and [e["step"] for e in resumed.evals] == [6]
    again = run_steps(tmp_path, 20, tables=tables, config=EVAL_EVERY_2)
    assert again.run.state.step == 6 and again.hooks("on_log") == again.hooks("on_eval") == []
    assert again.calls[-1].kwargs["outcome"] == "stopped"
    assert "stopping before the first step: early stopping: this run already stopped at step 6" in caplog.text


def test_a_metric_the_evaluation_does_not_report_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"early-stopping.metric: 'valid/acc' is not among .*valid/loss"):
        run_steps(tmp_path, 6, tables={"early-stopping": {"metric": "valid/acc"}}, config=EVAL_EVERY_2)


def test_a_run_that_never_evaluates_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"early-stopping: watches valid/loss, but this run never evaluates"):
        run_steps(tmp_path, 6, tables={"early-stopping": {}})


@pytest.mark.slow
def test_two_ranks_stop_and_keep_the_best_at_the_same_steps_as_one(tmp_path: Path) -> None:
    """Decisions taken at an evaluation step are agreed at that step: 2 gloo ranks stop after
    step 6 as one rank does, exit 0, with the step-6 checkpoint and the reason logged, and keep
    the best evaluation's checkpoint (step 2, no save step) as checkpoints/best."""
    steps = {}
    for name, ranks in (("one", 1), ("two", 2)):
        config = tmp_path / f"{name}.toml"
        config.write_text(
            tiny_gpt_config(
                tmp_path / name,
                micro_batch_size=4,
                global_batch_size=8,
                train_iters=20,
                log_interval=2,
                eval_interval=2,
                eval_iters=1,
            )
            + "\n[plugins.early-stopping]\npatience = 2\nmin_delta = 100.0\n"
            + '[checkpoint]\nkeep_last = 1\n[plugins.keep-best]\nmetric = "valid/loss"\nmode = "max"\n'
        )
        result = in_one_job(tmp_path, ranks, [["run", str(config)]], name)  # one rank: this process
        assert "early stopping: valid/loss did not improve" in result.stderr
        steps[name] = max(r["step"] for r in metrics_rows(tmp_path / name))
        checkpoints = tmp_path / name / "checkpoints"
        assert (checkpoints / "latest").read_text() == "6\n"
        assert os.readlink(checkpoints / "best") == "step_00000002"
        assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_00000002", "step_00000006"]
    assert steps == {"one": 6, "two": 6}
