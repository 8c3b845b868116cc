"""The ``local-checkpoint`` plugin: a non-persistent checkpoint every few steps, in host memory,
so a restart — in-process or by the launcher — loses at most those steps; durable checkpoints
stay where and when they were; a new job never resumes from another job's local state."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run_train
from test_inprocess_restart import config as two_rank_config
from test_inprocess_restart import losses
from test_launcher import free_port

from coretrain import UserError
from coretrain.testing import run_steps, tiny_config, write_config

CONFIG = {"train": {"log_interval": 1}, "checkpoint": {"save_interval": 4}}
WRITTEN = {"metrics-file": {}}


def local(tmp_path: Path) -> dict[str, Any]:
    return {"local-checkpoint": {"local_dir": str(tmp_path / "shm")}}


def steps_in(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) if root.is_dir() else []


def resumed_from(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from")]


def test_an_in_process_restart_resumes_from_the_local_checkpoint_of_the_step_before_the_fault(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    whole = run_steps(tmp_path / "whole", 12, config=CONFIG, tables=WRITTEN)
    tables = {**WRITTEN, **local(tmp_path), "fault-injection": {"action": "raise", "step": 7}, "inprocess-restart": {}}
    with caplog.at_level("INFO", logger="coretrain"):
        restarted = run_steps(tmp_path / "restarted", 12, config=CONFIG, tables=tables)
    assert restarted.exit_code == 0 and losses(restarted.output_dir) == losses(whole.output_dir)
    said = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("in-process restart 1: resumed at step 6, ") for line in said), said
    assert resumed_from(caplog)[0].startswith(f"resumed from {tmp_path / 'shm'}")
    # durable checkpoints are the cadence's and the end's, as without the plugin; the local tier is gone
    assert steps_in(restarted.output_dir / "checkpoints") == ["step_00000004", "step_00000008", "step_00000012"]
    assert list((tmp_path / "shm").iterdir()) == []


def failed_at_7(tmp_path: Path, name: str) -> Path:
    """A run that raises at step 7 with no in-process restart: its local tier is kept, the newest only."""
    fault = {"fault-injection": {"action": "raise", "step": 7}}
    with pytest.raises(Exception, match="fault-injection: raised"):
        run_steps(tmp_path / name, 12, config=CONFIG, tables={**WRITTEN, **local(tmp_path), **fault})
    (folder,) = (tmp_path / "shm").iterdir()
    assert steps_in(folder) == ["step_00000006"]
    assert steps_in(tmp_path / name / "out" / "checkpoints") == ["step_00000004"]
    return folder


def test_the_launchers_next_attempt_resumes_from_local_and_a_new_job_from_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    whole = run_steps(tmp_path / "whole", 12, config=CONFIG, tables=WRITTEN)
    folder = failed_at_7(tmp_path, "run")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun --max-restarts started the job again
    with caplog.at_level("INFO", logger="coretrain"):
        again = run_steps(tmp_path / "run", 12, config=CONFIG, tables={**WRITTEN, **local(tmp_path)})
    assert resumed_from(caplog) == [f"resumed from {folder / 'step_00000006'} (step 6, 48 samples consumed)"]
    assert losses(again.output_dir) == losses(whole.output_dir)

    caplog.clear()
    failed_at_7(tmp_path, "other")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a new job in the same output directory
    with caplog.at_level("INFO", logger="coretrain"):
        run_steps(tmp_path / "other", 12, config=CONFIG, tables={**WRITTEN, **local(tmp_path)})
    assert resumed_from(caplog)[0].startswith(f"resumed from {tmp_path / 'other' / 'out' / 'checkpoints'}")


def test_a_persistent_save_due_at_the_same_step_wins(tmp_path: Path) -> None:
    """Step 4 is the cadence's: saved to checkpoints/ (not the local tier) even though the plugin asked too."""
    fault = {"fault-injection": {"action": "raise", "step": 5}}
    with pytest.raises(Exception, match="fault-injection: raised"):
        run_steps(tmp_path / "run", 8, config=CONFIG, tables={**local(tmp_path), **fault})
    (folder,) = (tmp_path / "shm").iterdir()
    assert steps_in(folder) == ["step_00000003"]
    assert steps_in(tmp_path / "run" / "out" / "checkpoints") == ["step_00000004"]


MACHINE = """
import os, sys
from pathlib import Path
import torch.distributed as dist
from coretrain_local_checkpoint import sharing
from coretrain_local_checkpoint.machines import find_copies

sharing.PIECE = 7  # files go in several pieces
dist.init_process_group("gloo")
rank, directory, act = dist.get_rank(), Path(sys.argv[1]), sys.argv[2]
copies, job = find_copies(directory, rank, 2, new_job=False)
getattr(sharing, act)(copies, directory)
"""


def saved_by_two_machines(tmp_path: Path, step: int, lost: str = "") -> tuple[Path, Path]:
    """What the core leaves after a local save of ``step`` by two ranks on two machines, each with
    its own local_dir: rank 0's machine the committed step, rank 1's its own file in step_N.tmp."""
    first, second = tmp_path / "a" / "coretrain-x", tmp_path / "b" / "coretrain-x"
    committed, written = first / f"step_{step:08d}", second / f"step_{step:08d}.tmp"
    for name, data in {"manifest.json": b'{"step": %d}' % step, "model.pt": bytes(range(40)) * step}.items():
        (committed / name).parent.mkdir(parents=True, exist_ok=True)
        (committed / name).write_bytes(data)
    (committed / "rank_00000.pt").write_bytes(b"zero" * step)
    (committed / "sharded").mkdir()
    (committed / "sharded" / ".metadata").write_bytes(b"")
    if lost != "rank 1's file":
        written.mkdir(parents=True, exist_ok=True)
        (written / "rank_00001.pt").write_bytes(b"one" * step)
    return first, second


def as_machines(tmp_path: Path, act: str, *directories: Path) -> None:
    """Two processes on gloo, each playing one machine that sees one of ``directories``."""
    script = tmp_path / "machine.py"
    script.write_text(MACHINE)
    port, started = free_port(), []
    for rank, directory in enumerate(directories):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        started.append(subprocess.Popen([sys.executable, str(script), str(directory), act], env=env))
    assert [machine.wait(timeout=120) for machine in started] == [0, 0]


def files_of(step_dir: Path) -> dict[str, bytes]:
    return {p.relative_to(step_dir).as_posix(): p.read_bytes() for p in step_dir.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_each_machine_gets_a_whole_copy_of_a_local_save_and_a_new_machine_gets_the_newest_copy(
    tmp_path: Path,
) -> None:
    """local_dir on two machines is two directories: after a local save each holds the whole
    checkpoint (its ranks' files and the other machine's), byte for byte; a machine that comes
    with an empty local_dir gets it before a resume; every machine then offers the same steps."""
    first, second = saved_by_two_machines(tmp_path, 5)
    whole = {**files_of(first / "step_00000005"), **files_of(second / "step_00000005.tmp")}
    as_machines(tmp_path, "replicate", first, second)
    assert files_of(first / "copies" / "step_00000005") == whole
    assert files_of(second / "copies" / "step_00000005") == whole
    assert not (second / "step_00000005.tmp").exists()  # its file is in the whole copy

    saved_by_two_machines(tmp_path, 6, lost="rank 1's file")  # then machine b goes down before the copy
    shutil.rmtree(first / "step_00000005")  # (the core keeps the newest local save only)
    third = tmp_path / "c" / "coretrain-x"
    as_machines(tmp_path, "place_for_resume", first, third)
    for directory in (first, third):
        assert steps_in(directory) == ["step_00000005", "step_00000006"]  # the resume tries 6, then 5
        assert files_of(directory / "step_00000005") == whole
    assert "rank_00001.pt" not in files_of(third / "step_00000006")


def test_with_saving_off_it_is_one_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="plugins.local-checkpoint: checkpoint.save is false"):
        run_steps(tmp_path, 2, config={"checkpoint": {"save": False}}, tables=local(tmp_path))


@pytest.mark.slow
def test_two_gloo_ranks_restart_in_process_from_the_local_checkpoint_and_agree_on_requests(
    tmp_path: Path, site: Path, uninterrupted_losses: list[float]
) -> None:
    """The issue's case with a local tier: rank 1 raises at step 8; both resume from step 7 (the
    local checkpoint asked for at 6, saved one step late as requests are agreed), and the losses
    are an uninterrupted run's. Then a request only rank 1 makes: a non-persistent one at step 3
    is saved by both ranks into the local tier; with rank 0 asking for a persistent one at the
    same step, both save to checkpoints/."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(site)}
    shm = {"local_dir": str(tmp_path / "shm")}
    fault = {"action": "raise", "step": 8, "ranks": [1]}
    restarted = two_rank_config(
        tmp_path, "restarted", **{"fault-injection": fault, "inprocess-restart": {}, "local-checkpoint": shm}
    )
    job = run_train(restarted, "--nproc-per-node", "2", cwd=tmp_path, env=env)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "in-process restart 1: resumed at step 7, " in job.stderr
    assert losses(tmp_path / "restarted") == uninterrupted_losses

    rarely = {"local_dir": str(tmp_path / "shm"), "local_save_interval": 100}  # the plugin itself never asks
    for name, persistent_ranks in (("alone", []), ("both", [0])):
        asks = {"at_step": 3, "non_persistent_ranks": [1], "persistent_ranks": persistent_ranks}
        stop = {"action": "raise", "step": 6}  # a failed job keeps its local tier, for the test to read
        plugins = {"local-checkpoint": rarely, "request-checkpoint": asks, "fault-injection": stop}
        sections = tiny_config(
            tmp_path / name,
            train={"train_iters": 12, "eval_interval": 100},
            checkpoint={"save_interval": 100},
            distributed={"backend": "gloo"},
            plugins=plugins,
        )
        config_path = str(write_config(tmp_path / f"{name}.toml", sections))
        assert run_train(config_path, "--nproc-per-node", "2", cwd=tmp_path, env=env).returncode != 0
    (alone,) = [d for d in (tmp_path / "shm").iterdir() if steps_in(d)]
    assert [sorted(p.name for p in (alone / s).iterdir()) for s in steps_in(alone)] == [
        ["checkpoint.json", "model.pt", "optimizer.pt", "rank_00000.pt", "rank_00001.pt"]
    ]
    assert steps_in(tmp_path / "alone" / "checkpoints") == []
    assert steps_in(tmp_path / "both" / "checkpoints") == steps_in(alone)  # the same step, persistent
