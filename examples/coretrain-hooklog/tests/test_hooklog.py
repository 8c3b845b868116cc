"""The example plugin's own tests, written as its author would: with coretrain.testing, after
``pip install -e .``."""

from __future__ import annotations

import json
from pathlib import Path

from coretrain_hooklog import HookLog

from coretrain.testing import run_ranks, run_steps, stop_and_resume


def calls(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "hooklog.jsonl").read_text().splitlines()]


def test_records_each_interval_hook_with_its_step(tmp_path: Path) -> None:
    result = run_steps(tmp_path, steps=4, plugins={"hooklog": HookLog()})
    assert result.exit_code == 0
    assert [(c["hook"], c["step"]) for c in calls(result.output_dir)] == [
        ("on_train_start", 0),
        ("on_log", 2),
        ("on_log", 4),
        ("on_checkpoint", 4),
        ("on_eval", 4),
        ("on_train_end", 4),
    ]


def test_every_step_adds_the_per_step_hooks(tmp_path: Path) -> None:
    result = run_steps(tmp_path, steps=3, plugins={"hooklog": HookLog(every_step=True)})
    steps = [c["step"] for c in calls(result.output_dir) if c["hook"] == "post_step"]
    assert steps == [1, 2, 3]


def test_the_count_of_steps_survives_a_restart(tmp_path: Path) -> None:
    first, second = stop_and_resume(tmp_path, stop_at=3, steps=6, plugins={"hooklog": HookLog()})
    ends = [c for c in calls(second.output_dir) if c["hook"] == "on_train_end"]
    assert [(c["outcome"], c["steps_seen"]) for c in ends] == [("exit_interval", 3), ("completed", 6)]


def test_enabled_from_its_toml_table_when_installed(tmp_path: Path) -> None:
    result = run_steps(tmp_path, steps=2, tables={"hooklog": {"path": "calls.jsonl"}})
    assert (result.output_dir / "calls.jsonl").is_file()


def test_on_two_ranks_only_rank_0_writes(tmp_path: Path) -> None:
    finished = run_ranks(tmp_path, nproc=2, steps=4, config={"plugins": {"hooklog": {"every_step": True}}})
    assert finished.returncode == 0, finished.stderr
    recorded = calls(tmp_path / "out")  # one writer: each step once, one end
    assert [c["step"] for c in recorded if c["hook"] == "post_step"] == [1, 2, 3, 4]
    assert [c["outcome"] for c in recorded if c["hook"] == "on_train_end"] == ["completed"]
