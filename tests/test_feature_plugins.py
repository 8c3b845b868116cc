"""Megatron-style training features as plugins, each exercised by a real `coretrain run`."""

from __future__ import annotations

import gc
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, run_cli
from helpers_inprocess import config, train

from coretrain import hookimpl

TESTS = str(REPO / "tests")


def faulty_run(tmp_path: Path, guards: str, nan_at: list[int] = (), spike_at: list[int] = (),
               train_iters: int = 12) -> tuple[Any, list[dict]]:
    path = tmp_path / "c.toml"
    path.write_text(f"""
[run]
output_dir = "{tmp_path / 'out'}"
[model]
provider = "faulty_models:make_faulty"
[model.options]
nan_at = {list(nan_at)}
spike_at = {list(spike_at)}
[data]
provider = "helpers_inprocess:make_data"
[train]
micro_batch_size = 8
train_iters = {train_iters}
log_interval = 1
eval_iters = 0
[optimizer]
lr = 0.01
[plugins.guards]
{guards}
""")
    result = run_cli("run", str(path), cwd=tmp_path, env={"PYTHONPATH": TESTS})
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    return result, rows


def test_guards_skip_nan_and_spike_updates_and_keep_training(tmp_path: Path) -> None:
    result, rows = faulty_run(tmp_path, 'action = "skip"\nwindow = 5', nan_at=[5], spike_at=[8])
    assert result.returncode == 0, result.stderr
    assert "guards: step 5: loss is nan; update skipped" in result.stderr
    assert "guards: step 8: loss spiked to" in result.stderr
    assert [r["skipped_updates"] for r in rows if r["step"] in (4, 5, 8, 12)] == [0.0, 1.0, 2.0, 2.0]
    weights = torch.load(tmp_path / "out" / "checkpoints" / "step_00000012" / "model.pt", weights_only=True)
    assert all(torch.isfinite(w).all() for w in weights.values())          # the NaN never reached the weights


def test_guards_warn_lets_the_update_through(tmp_path: Path) -> None:
    result, rows = faulty_run(tmp_path, 'action = "warn"', spike_at=[6])
    assert result.returncode == 0 and "updating anyway (action = warn)" in result.stderr
    assert rows[-1]["skipped_updates"] == 0.0


def test_guards_stop_checkpoints_and_exits_with_its_code(tmp_path: Path) -> None:
    result, _ = faulty_run(tmp_path, 'action = "stop"\nexit_code = 7', nan_at=[5])
    assert result.returncode == 7
    assert "stopping at step 5: guards: loss is nan" in result.stderr
    assert (tmp_path / "out" / "checkpoints" / "step_00000005").is_dir()


def test_guards_iterations_to_skip_consume_data_without_updates(tmp_path: Path) -> None:
    result, rows = faulty_run(tmp_path, "iterations_to_skip = [3, 4]")
    assert result.returncode == 0, result.stderr
    assert rows[-1]["skipped_updates"] == 2.0 and rows[-1]["consumed_samples"] == 12 * 8


class GCWatcher:
    def __init__(self) -> None:
        self.enabled_during: set[bool] = set()

    @hookimpl
    def pre_step(self) -> None:
        self.enabled_during.add(gc.isenabled())


def test_gc_turns_automatic_collection_off_collects_on_schedule_and_restores(tmp_path: Path, no_autoload: None) -> None:
    watcher = GCWatcher()
    run, code = train(config(tmp_path, train={"train_iters": 10, "eval_interval": 5, "eval_iters": 1},
                             plugins={"gc": {"interval": 4}}), ("watcher", watcher))
    assert code == 0 and gc.isenabled()
    assert watcher.enabled_during == {False}
    # at start, steps 4 and 8, before the evals at 5 and 10, after each eval (5, 10)
    assert run.plugins.get("gc").collections == 1 + 2 + 2 + 2
