"""The ``loss-scale`` plugin: fp16 loss scaling as Megatron's DynamicGradScaler moves it (checked
against Megatron-Core itself by benchmarks/loss_scale_parity.py: 200 of 200 overflow patterns)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO, load_script
from coretrain_loss_scale import MegatronGradScaler

from coretrain import UserError
from coretrain.testing import run_steps, stop_and_resume


def scales(pattern: str, initial: float, minimum: float, hysteresis: int, static: bool = False) -> list[float]:
    """The scale after each step of ``pattern`` ("x": the gradients overflowed, "."), window 2:
    the parity benchmark's own replay (which CI runs no other way)."""
    parity = load_script(REPO / "benchmarks" / "loss_scale_parity.py")
    return list(parity.our_scales([step == "x" for step in pattern], initial, minimum, 2, hysteresis, static))


def test_the_scale_backs_off_after_hysteresis_overflows_and_grows_after_a_clean_window() -> None:
    # hysteresis 2: the first overflow keeps the scale; the count is reset by growth, not by a clean step
    assert scales("xxx..x.x", 1024.0, 300.0, hysteresis=2) == [1024, 512, 300, 300, 600, 600, 600, 300]
    assert scales("xx...x", 128.0, 1.0, hysteresis=2, static=True) == [128] * 6
    dynamic = MegatronGradScaler("cpu", 1024.0, 1.0, window=2, hysteresis=3, static=False)
    dynamic.hysteresis_tracker, dynamic.clean_steps = 1, 1
    restored = MegatronGradScaler("cpu", 1.0, 1.0, window=2, hysteresis=3, static=False)
    restored.load_state_dict(dynamic.state_dict())  # as a resume does: the trackers come back too
    assert (restored.get_scale(), restored.hysteresis_tracker, restored.clean_steps) == (1024.0, 1, 1)


def run_fp16(tmp_path: Path, name: str, table: dict[str, float] | None, steps: int = 12) -> list[dict[str, float]]:
    config = {"run": {"precision": "fp16"}, "train": {"log_interval": 1}}
    tables = {"loss-scale": table} if table is not None else {}
    return [
        m
        for m in run_steps(tmp_path / name, steps, tables=tables, config=config).metrics
        if "loss" in m or "skipped_updates" in m
    ]


def test_an_fp16_run_skips_one_more_overflow_with_hysteresis_2_than_1_and_scales_alike_after(tmp_path: Path) -> None:
    """A real fp16 run (CPU autocast) starting at 2**24 overflows until the scale is small
    enough; with hysteresis 2 the first overflow keeps the scale, so one more step is skipped."""
    one = run_fp16(tmp_path, "one", {"initial_loss_scale": 2.0**24, "hysteresis": 1})
    two = run_fp16(tmp_path, "two", {"initial_loss_scale": 2.0**24, "hysteresis": 2})
    skipped_one, skipped_two = one[-1]["skipped_updates"], two[-1]["skipped_updates"]
    assert 0 < skipped_one < 12 and skipped_two == skipped_one + 1
    assert one[-1]["loss_scale"] == two[-1]["loss_scale"] < 2.0**24


def test_loss_scaling_without_fp16_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r'plugins.loss-scale: loss scaling is for run.precision = "fp16"'):
        run_steps(tmp_path, 2, tables={"loss-scale": {}})


def test_a_resumed_fp16_run_scales_as_the_uninterrupted_one(tmp_path: Path) -> None:
    """The trackers travel in the checkpoint (the rank file's grad_scaler state): stopped at step 6,
    mid-way through its hysteresis, the resumed run moves its scale at the same steps."""
    table = {"initial_loss_scale": 2.0**24, "hysteresis": 2}
    config = {"run": {"precision": "fp16"}, "train": {"log_interval": 1}}
    whole = run_steps(tmp_path / "whole", 12, tables={"loss-scale": table}, config=config).metrics
    first, second = stop_and_resume(tmp_path / "halves", 6, 12, tables={"loss-scale": table}, config=config)

    def trail(metrics: list[dict[str, float]]) -> list[tuple[float, ...]]:
        return [(m["step"], m["loss_scale"], m["skipped_updates"]) for m in metrics if "loss_scale" in m]

    assert trail(first.metrics) + trail(second.metrics) == trail(whole)
