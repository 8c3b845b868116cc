"""coretrain sweep: a grid of runs, one output dir each, run here or as a SLURM array job."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli
from coretrain_sweep.grid import parse_grid, points

from coretrain.testing import tiny_config, write_config


def config_file(tmp_path: Path) -> Path:
    return write_config(tmp_path / "c.toml", tiny_config(tmp_path / "out", train={"train_iters": 4}))


def test_the_grid_is_every_combination_named_by_its_values() -> None:
    grid = parse_grid(["optimizer.lr=[1e-3, 3e-3]", "train.micro_batch_size=[4,8]", 'run.precision=["fp32"]'])
    planned = points(grid)
    assert [p.name for p in planned] == [
        "lr=0.001,micro_batch_size=4,precision=fp32",
        "lr=0.001,micro_batch_size=8,precision=fp32",
        "lr=0.003,micro_batch_size=4,precision=fp32",
        "lr=0.003,micro_batch_size=8,precision=fp32",
    ]
    assert planned[1].sets == ["optimizer.lr=0.001", "train.micro_batch_size=8", 'run.precision="fp32"']
    assert [p.name for p in points(parse_grid(["optimizer.lr=[1]", "plugins.x.lr=[2]"]))] == [
        "optimizer.lr=1,plugins.x.lr=2"
    ]


@pytest.mark.parametrize(
    ("grid", "message"),
    [
        ("optimizer.lr=1e-3", "expected KEY.PATH=[V1, V2, ...]"),
        ("optimizer.lr=[]", "expected KEY.PATH=[V1, V2, ...]"),
        ("optimizer.lr", "expected KEY.PATH=[V1, V2, ...]"),
        ("optimizer.betas=[[0.9, 0.95]]", "each value must be a number, a string or a boolean"),
    ],
)
def test_a_bad_grid_is_one_clear_error(tmp_path: Path, cli: Any, grid: str, message: str) -> None:
    result = cli("sweep", str(config_file(tmp_path)), "--grid", grid, cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr


def test_grids_that_cannot_be_run_as_asked_are_refused_before_anything_is_loaded(tmp_path: Path, cli: Any) -> None:
    config = str(config_file(tmp_path))
    many = ",".join(map(str, range(10_000)))
    refused = {
        ("--grid", f"train.train_iters=[{many}]", "--grid", f"train.log_interval=[{many}]"): (
            "--grid: 100,000,000 points (10000 × 10000); more than --max-points 1,000"
        ),
        (
            "--grid",
            'run.output_dir=["a", "b"]',
        ): "--grid run.output_dir: the sweep sets it for each point",
        ("--grid", 'run.name=["a/b", "a_b"]'): "would share the directory 'name=a_b'",
    }
    for grid, message in refused.items():
        result = cli("sweep", config, *grid, cwd=tmp_path)
        assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "out").exists()


def test_the_array_job_quotes_what_it_writes_and_refuses_a_directory_it_cannot(tmp_path: Path, cli: Any) -> None:
    """A newline in run.output_dir ran a command when the script ran: the #SBATCH line cannot
    hold it, so it is refused; spaces, % and shell syntax are quoted."""
    config = str(config_file(tmp_path))
    odd = tmp_path / "runs 100% $(touch pwned)"
    grid = ("--grid", "optimizer.lr=[0.01, 0.1]", "--launcher", "slurm")
    written = cli("sweep", config, *grid, "--set", f"run.output_dir={json.dumps(str(odd))}", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    script = (odd / "sweep" / "sweep.sbatch").read_text()
    assert f'#SBATCH --output="{str(odd).replace("%", "%%")}/sweep/slurm-%A_%a.out"' in script
    line = next(line for line in script.splitlines() if line.startswith("coretrain sweep"))
    tokens = shlex.split(line)
    assert tokens[tokens.index("--set") + 1] == f"run.output_dir={json.dumps(str(odd))}"  # one word, as given
    newline = json.dumps(str(tmp_path / "x\ntouch pwned"))
    refused = cli("sweep", config, *grid, "--set", f"run.output_dir={newline}", cwd=tmp_path)
    assert refused.returncode == 2 and "a newline, control character or double quote cannot go" in refused.stderr
    assert not list(tmp_path.glob("x*"))  # nothing made


def test_every_points_config_is_checked_before_anything_runs(tmp_path: Path, cli: Any) -> None:
    result = cli("sweep", str(config_file(tmp_path)), "--grid", "train.micro_batch_size=[4, 0]", cwd=tmp_path)
    assert result.returncode == 2
    assert "sweep point 1 (micro_batch_size=0)" in result.stderr and "train.micro_batch_size" in result.stderr
    assert not (tmp_path / "out" / "sweep").exists()


def test_dry_run_lists_the_points_and_writes_the_plan(tmp_path: Path, cli: Any) -> None:
    result = cli("sweep", str(config_file(tmp_path)), "--grid", "optimizer.lr=[0.01, 0.1]", "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    plan = json.loads((tmp_path / "out" / "sweep" / "sweep.json").read_text())
    assert [p["values"] for p in plan["points"]] == [{"optimizer.lr": 0.01}, {"optimizer.lr": 0.1}]
    assert str(tmp_path / "out" / "sweep" / "lr=0.1") in result.stdout
    assert not (tmp_path / "out" / "sweep" / "lr=0.1").exists()


@pytest.mark.slow  # two `coretrain run` processes, then a SLURM array task run by bash
def test_a_sweep_runs_each_point_in_its_own_dir_and_report_compares_them(tmp_path: Path) -> None:
    config = config_file(tmp_path)
    grid = ("--grid", "optimizer.lr=[0.001, 0.03]", "--grid", "train.micro_batch_size=[8]")
    result = run_cli("sweep", str(config), *grid, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    root = tmp_path / "out" / "sweep"
    for name, (lr, micro) in {
        "lr=0.001,micro_batch_size=8": (0.001, 8),
        "lr=0.03,micro_batch_size=8": (0.03, 8),
    }.items():
        saved = (root / name / "config.toml").read_text()
        assert f"lr = {lr}" in saved and f"micro_batch_size = {micro}" in saved
        assert (root / name / "checkpoints" / "step_00000004").is_dir()
    compared = run_cli("report", str(root), cwd=tmp_path, env={"COLUMNS": "250"})
    assert compared.returncode == 0, compared.stderr
    assert "2 runs" in compared.stdout and "lr=0.03,micro_batch_size=8" in compared.stdout
    assert (root / "report" / "loss.png").is_file()

    slurm = run_cli("sweep", str(config), *grid, "--set", "train.train_iters=6", "--launcher", "slurm", cwd=tmp_path)
    assert slurm.returncode == 0, slurm.stderr
    script = root / "sweep.sbatch"
    assert "#SBATCH --array=0-1" in script.read_text()
    env = {
        "SLURM_ARRAY_TASK_ID": "1",
        "SLURM_ARRAY_JOB_ID": "7",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    task = run_cli(str(script), cwd=tmp_path, env=env, command=("bash",))
    assert task.returncode == 0, task.stderr
    trained = {p.name: (p / "checkpoints" / "step_00000006").is_dir() for p in root.iterdir() if "=" in p.name}
    assert trained == {
        "lr=0.001,micro_batch_size=8": False,
        "lr=0.03,micro_batch_size=8": True,  # task 1 resumed its point and trained it on to step 6
    }
