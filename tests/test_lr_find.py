"""coretrain lr-find: the learning-rate range test, beside the run and without touching it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from coretrain_lr_find.finder import SMOOTHING, LRFinder

import coretrain
from coretrain import Run, hookimpl
from coretrain.testing import tiny_config, write_config


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_lr_find_sweeps_beside_the_run_and_leaves_its_checkpoints_alone(tmp_path: Path, cli: Any) -> None:
    config = write_config(tmp_path / "c.toml", tiny_config(tmp_path / "out", train={"train_iters": 4}))
    assert cli("run", str(config), cwd=tmp_path).returncode == 0
    # run.log aside: in one test process the first command's log handler is still installed
    files = [p for p in (tmp_path / "out").rglob("*") if "lr_find" not in p.parts and p.name != "run.log"]
    before = {p: p.stat().st_mtime_ns for p in files}
    found = cli("lr-find", str(config), "--steps", "30", "--min-lr", "1e-5", "--max-lr", "0.1", cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    swept = rows(tmp_path / "out" / "lr_find" / "lr_find.jsonl")
    assert len(swept) == 30 and swept[0]["lr"] == 1e-5 and math.isclose(swept[-1]["lr"], 0.1)
    ratio = 1e4 ** (1 / 30)  # exponential, on Lightning's schedule: step 2 at min_lr · ratio ** 2
    assert [round(b["lr"] / a["lr"], 9) for a, b in zip(swept, swept[1:])] == [round(ratio**2, 9)] + [
        round(ratio, 9)
    ] * 28
    average = 0.0  # Lightning's _LRCallback: its bias correction counts global_step + 1, already past the step
    for step, row in enumerate(swept, start=1):
        average = 0.98 * average + (1 - 0.98) * row["loss"]
        assert row["smoothed"] == average / (1 - 0.98 ** (step + 1))
    assert (tmp_path / "out" / "lr_find" / "lr_find.png").is_file()
    assert not (tmp_path / "out" / "lr_find" / "checkpoints").exists()
    assert {p: p.stat().st_mtime_ns for p in before} == before  # nothing of the run changed
    suggested = [line for line in found.stdout.splitlines() if line.startswith("suggested (steepest): --set")]
    assert len(suggested) == 1 and 1e-5 <= float(suggested[0].rsplit("=", 1)[1]) <= 0.1
    named = {line.split()[0]: line.split()[1] for line in found.stdout.splitlines() if line.startswith("  ")}
    assert set(named) == {"steepest", "lightning", "minimum/10"}
    assert "(steepest fall against lr: Lightning's rule)" in found.stdout
    again = cli(
        "lr-find",
        str(config),
        "--steps",
        "30",
        "--min-lr",
        "1e-5",
        "--max-lr",
        "0.1",
        "--rule",
        "lightning",
        cwd=tmp_path,
    )
    assert f"suggested (lightning): --set optimizer.lr={named['lightning']}" in again.stdout


def test_a_run_counted_in_epochs_is_swept_in_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from coretrain_lr_find.command import lr_find

    config = write_config(tmp_path / "c.toml", tiny_config(tmp_path / "out", train={"train_epochs": 3}))
    assert lr_find(str(config), [], min_lr=1e-5, max_lr=0.1, steps=20, diverge=4.0) == 0
    assert len(rows(tmp_path / "out" / "lr_find" / "lr_find.jsonl")) == 20
    assert "suggested (steepest): --set optimizer.lr=" in capsys.readouterr().out


class SeenRates:
    """Reads the rate each optimizer step really uses, just before it steps."""

    def __init__(self) -> None:
        self.rates: list[dict[float, float]] = []

    @hookimpl
    def before_update(self, run: Run) -> None:
        self.rates.append({group.get("lr_mult", 1.0): group["lr"] for group in run.optimizer.param_groups})


def test_the_optimizer_steps_at_the_tests_rate_in_each_groups_proportion(tmp_path: Path) -> None:
    """With optimizer-overrides giving biases 0.1 × the rate, the warmup schedule of the config
    is overridden step by step, and the biases keep their share."""
    finder, seen = LRFinder(min_lr=1e-4, max_lr=1e-2, steps=5), SeenRates()
    config = tiny_config(
        tmp_path / "out",
        train={"train_iters": 5},
        scheduler={"warmup_iters": 3},
        plugins={"optimizer-overrides": {"rules": [{"pattern": "*.bias", "lr_mult": 0.1}]}},
    )
    coretrain.train(config, plugins={"lr-find": finder, "seen": seen})
    expected = [1e-4] + [1e-4 * 100 ** (k / 5) for k in range(2, 6)]  # Lightning's sweep: no 100 ** (1/5)
    assert [rates[1.0] for rates in seen.rates] == pytest.approx(expected)
    assert [rates[0.1] for rates in seen.rates] == pytest.approx([0.1 * lr for lr in expected])


def test_a_diverging_loss_ends_the_sweep_early_without_a_checkpoint(tmp_path: Path) -> None:
    finder = LRFinder(min_lr=1e-3, max_lr=1e6, steps=60)
    config = tiny_config(tmp_path / "out", train={"train_iters": 60}, checkpoint={"save": False})
    result = coretrain.train(config, plugins={"lr-find": finder})
    assert result.outcome == "stopped" and 10 < result.step < 60
    assert len(finder.losses) == result.step


def test_the_suggestions_on_a_known_curve() -> None:
    """A loss that falls fastest at lr 1e-3 (in log lr) and is lowest at 1e-1."""
    finder = LRFinder(min_lr=1e-6, max_lr=1.0, steps=61)
    finder.lrs = [finder.lr_at(step) for step in range(1, 62)]
    finder.smoothed = [
        -math.tanh(math.log10(lr) + 3) + (2.0 * (math.log10(lr) + 1) ** 2 if lr > 0.1 else 0.0) for lr in finder.lrs
    ]
    found = finder.suggestions()
    assert math.isclose(found["steepest"], 1e-3, rel_tol=0.26)
    lowest = min(zip(finder.smoothed[6:-5], finder.lrs[6:-5]))[1]  # fastai's window: [61 // 10 : -5]
    assert math.isclose(found["minimum/10"], lowest / 10)
    # Lightning's rule differentiates against lr itself (numpy's gradient: the same second-order
    # differences on uneven steps): a slope against log(lr) divided by lr, which leans to smaller rates
    kept = slice(10, -1)
    gradient = np.gradient(np.float32(finder.smoothed[kept]), np.float32(finder.lrs[kept]))
    assert found["lightning"] == finder.lrs[10 + int(np.argmin(gradient))]
    assert found["lightning"] < found["steepest"]


def test_the_minimum_rule_reads_fastais_window_not_the_first_steps_halved_loss() -> None:
    """Lightning's bias correction halves the first smoothed loss (``/ (1 - 0.98 ** 2)`` after one
    step), so on a curve that falls by less than half the first point is the lowest of all, and the
    minimum rule suggested min_lr / 10 (a user's regression got 1e-9). fastai's ``lr_find`` reads
    ``losses[num_it // 10 : -5]``: its first tenth and last five points left out, and the curve
    up to its first non-finite loss."""
    finder = LRFinder(min_lr=1e-8, max_lr=1.0, steps=100)
    for step in range(1, 101):
        finder.lrs.append(finder.lr_at(step))
        lr = finder.lrs[-1]
        loss = 4.0 - 1.5 * math.exp(-((math.log10(lr) + 1.5) ** 2)) + (float("nan") if step > 90 else 0.0)
        finder.losses.append(loss)
    average = 0.0
    for n, loss in enumerate(finder.losses, start=1):  # the finder's smoothing, Lightning's off-by-one kept
        average = SMOOTHING * average + (1 - SMOOTHING) * loss
        finder.smoothed.append(average / (1 - SMOOTHING ** (n + 1)))
    assert min(range(90), key=finder.smoothed.__getitem__) == 0  # the halved first point is the lowest
    kept = finder.smoothed[10:90]  # [100 // 10 : -5], up to the first NaN
    best = min(range(len(kept)), key=kept.__getitem__)
    assert finder.suggestions()["minimum/10"] == finder.lrs[10 + best] / 10
    assert 1e-3 < finder.suggestions()["minimum/10"] < 1e-1  # the fall near lr 10 ** -1.5, not 1e-9


def test_a_curve_too_short_for_the_asked_rule_falls_back_to_one_that_found_a_rate() -> None:
    """A loss that diverged at step 15 of 100 leaves fastai's window (``[10 : -5]``) empty: the
    minimum rule finds nothing, and ``--rule minimum/10`` takes the steepest instead of failing
    with a KeyError (the minimum was always found before its window was fastai's)."""
    from coretrain_lr_find.command import choose

    finder = LRFinder(min_lr=1e-6, max_lr=1.0, steps=100)
    finder.lrs = [finder.lr_at(step) for step in range(1, 16)]
    finder.smoothed = [4.0 - 0.1 * step for step in range(1, 16)]
    found = finder.suggestions()
    assert "minimum/10" not in found and "steepest" in found
    assert choose(found, "minimum/10") == "steepest" and choose(found, "steepest") == "steepest"
