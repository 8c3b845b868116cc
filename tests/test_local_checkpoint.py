"""The ``local-checkpoint`` plugin: a non-persistent checkpoint every few steps, in host memory,
so a restart — in-process or by the launcher — loses at most those steps; durable checkpoints
stay where and when they were; a new job never resumes from another job's local state."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from conftest import in_one_job
from test_inprocess_restart import config as two_rank_config
from test_inprocess_restart import losses
from test_launcher import free_port

from coretrain import Run, UserError, hookimpl
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
    folder = planned_folder(tmp_path, name)
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
    job = in_one_job(tmp_path, 2, [["run", restarted]], "restarted", env=env)
    assert "in-process restart 1: resumed at step 7, " in job.stderr
    assert losses(tmp_path / "restarted") == uninterrupted_losses

    rarely = {"local_dir": str(tmp_path / "shm"), "local_save_interval": 100}  # the plugin itself never asks
    failing = []
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
        failing.append({"args": ["run", str(write_config(tmp_path / f"{name}.toml", sections))], "expect": 1})
    in_one_job(tmp_path, 2, failing, "requests", env=env)
    (alone,) = [d for d in (tmp_path / "shm").iterdir() if steps_in(d)]
    assert [sorted(p.name for p in (alone / s).iterdir()) for s in steps_in(alone)] == [
        ["checkpoint.json", "model.pt", "optimizer.pt", "rank_00000.pt", "rank_00001.pt"]
    ]
    assert steps_in(tmp_path / "alone" / "checkpoints") == []
    assert steps_in(tmp_path / "both" / "checkpoints") == steps_in(alone)  # the same step, persistent

    # rank 1's local_dir is full (rank 0's is not): both skip every local save, agreed, and train on
    full = {"under": str(tmp_path / "shm"), "ranks": [1]}
    skipping = two_rank_config(tmp_path, "skipping", **{"local-checkpoint": shm, "full-disk": full})
    job = in_one_job(tmp_path, 2, [["run", skipping]], "skipping", env=env)
    said = [line for line in job.stderr.splitlines() if "non-persistent checkpoint of step" in line]
    assert len(said) == 2, job.stderr[-3000:]  # rank 0 says whose it was, rank 1 why
    assert any(line.startswith("coretrain:") and "skipped: rank 1 could not write its part" in line for line in said)
    assert any(line.startswith("coretrain[rank 1]:") and "No space left on device" in line for line in said)
    assert losses(tmp_path / "skipping") == uninterrupted_losses
    assert steps_in(tmp_path / "skipping" / "checkpoints") == ["step_00000004", "step_00000008", "step_00000012"]


# --------------------------------------------------------------------------- a private folder of the run's own


def planned_folder(tmp_path: Path, name: str) -> Path:
    """Where run ``name``'s folder goes in ``tmp_path/shm`` (its output directory made first, as
    the run's lock makes it: the name holds the directory's inode)."""
    from coretrain_local_checkpoint.folder import folder_name

    output_dir = tmp_path / name / "out"
    output_dir.mkdir(parents=True, exist_ok=True)
    (tmp_path / "shm").mkdir(exist_ok=True)
    return tmp_path / "shm" / folder_name(output_dir)


def test_a_symlink_planted_at_the_runs_folder_is_refused_and_its_target_left_untouched(
    tmp_path: Path, cli: Any
) -> None:
    """/dev/shm is writable by everyone: a link planted where the run's folder goes would make
    the run clear (and later resume from) wherever it points."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    planned_folder(tmp_path, "run").symlink_to(victim)
    config = write_config(
        tmp_path / "run.toml",
        tiny_config(tmp_path / "run" / "out", train={"train_iters": 4}, plugins=local(tmp_path)),
    )
    refused = cli("run", str(config), cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert "plugins.local-checkpoint.local_dir:" in line and "is a symbolic link" in line
    assert (victim / "thesis.tex").read_text() == "years of work" and sorted(os.listdir(victim)) == ["thesis.tex"]


@pytest.mark.parametrize("planted", ["another user's", "writable by others", "a file"])
def test_a_folder_that_is_not_the_users_own_private_one_is_refused(
    tmp_path: Path, planted: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import coretrain_local_checkpoint.folder as folder

    target = planned_folder(tmp_path, "run")
    if planted == "another user's":  # (the tests may run as root, who owns whatever it makes)
        monkeypatch.setattr(folder.os, "geteuid", lambda: os.getuid() + 4242)
        target = planned_folder(tmp_path, "run")
        target.mkdir()
        message = "belongs to another user"
    elif planted == "writable by others":
        target.mkdir()
        target.chmod(0o777)
        message = "can be written by other users"
    else:
        target.write_text("")
        message = "is not a directory"
    with pytest.raises(UserError, match=f"plugins.local-checkpoint.local_dir: .* {message}"):
        run_steps(tmp_path / "run", 2, tables=local(tmp_path))


def test_the_folder_is_private_and_keyed_by_the_output_directory_not_its_path(tmp_path: Path) -> None:
    """0700 with files 0600 (a failed job's copy, the whole config in it, stays in host memory);
    a directory now at an earlier one's path (another host's disk, seen through a shared
    /dev/shm) gets another folder."""
    from coretrain_local_checkpoint.folder import folder_name

    folder = failed_at_7(tmp_path, "run")
    assert folder.stat().st_mode & 0o777 == 0o700
    inside = list(folder.rglob("*"))
    assert inside and {p.stat().st_mode & 0o777 for p in inside} <= {0o700, 0o600}
    assert {p.stat().st_mode & 0o777 for p in inside if p.is_file()} == {0o600}

    same_path = tmp_path / "elsewhere" / "out"
    same_path.mkdir(parents=True)
    before = folder_name(same_path)
    same_path.rename(tmp_path / "elsewhere" / "moved")
    same_path.mkdir()
    assert folder_name(same_path) != before


def test_a_local_step_of_another_run_is_not_resumed_the_durable_one_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another run's step copied into this run's folder (a newer step, another seed): the restart
    takes this run's durable step 4, not it, and trains this run's losses."""
    other_config = {**CONFIG, "run": {"seed": 99}}
    fault = {"fault-injection": {"action": "raise", "step": 8}}
    with pytest.raises(Exception, match="fault-injection: raised"):
        run_steps(tmp_path / "other", 12, config=other_config, tables={**WRITTEN, **local(tmp_path), **fault})
    (foreign,) = [f for f in (tmp_path / "shm").iterdir() if steps_in(f) == ["step_00000007"]]
    whole = run_steps(tmp_path / "whole", 12, config=CONFIG, tables=WRITTEN)
    mine = failed_at_7(tmp_path, "run")
    shutil.rmtree(mine / "step_00000006")
    shutil.copytree(foreign / "step_00000007", mine / "step_00000007")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    with caplog.at_level("INFO", logger="coretrain"):
        again = run_steps(tmp_path / "run", 12, config=CONFIG, tables={**WRITTEN, **local(tmp_path)})
    said = [r.getMessage() for r in caplog.records]
    assert any("step_00000007 is another run's" in line and "removed" in line for line in said), said
    assert resumed_from(caplog)[0].startswith(f"resumed from {tmp_path / 'run' / 'out' / 'checkpoints'}")
    assert losses(again.output_dir) == losses(whole.output_dir)


def test_a_local_save_that_cannot_be_written_is_skipped_and_training_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, faults: Any
) -> None:
    """/dev/shm full: every local save fails; the run says so once and completes with the
    uninterrupted losses and its durable checkpoints, instead of failing at every restart."""
    whole = run_steps(tmp_path / "whole", 12, config=CONFIG, tables=WRITTEN)
    full = faults.FullDisk(under=str(tmp_path / "shm"))
    with caplog.at_level("INFO", logger="coretrain"):
        result = run_steps(
            tmp_path / "run", 12, config=CONFIG, tables={**WRITTEN, **local(tmp_path)}, plugins={"full": full}
        )
    assert result.exit_code == 0 and losses(result.output_dir) == losses(whole.output_dir)
    skipped = [r.getMessage() for r in caplog.records if "non-persistent checkpoint" in r.getMessage()]
    assert len(skipped) == 1 and "No space left on device" in skipped[0], skipped
    assert steps_in(result.output_dir / "checkpoints") == ["step_00000004", "step_00000008", "step_00000012"]


@pytest.mark.parametrize(
    ("local_dir", "message"),
    [
        ("relative/shm", "is a relative path; give an absolute one"),
        ("/proc/coretrain-local", "cannot make /proc/coretrain-local"),
        ("FILE", "is not a directory"),
    ],
)
def test_a_local_dir_that_cannot_hold_the_folder_is_one_error_naming_the_key(
    tmp_path: Path, local_dir: str, message: str
) -> None:
    if local_dir == "FILE":
        local_dir = str(tmp_path / "a-file")
        Path(local_dir).write_text("")
    with pytest.raises(UserError, match=f"plugins.local-checkpoint.local_dir: .*{message}"):
        run_steps(tmp_path / "run", 2, tables={"local-checkpoint": {"local_dir": local_dir}})


def test_without_room_for_two_local_checkpoints_local_saves_are_off_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Checked at start: a /dev/shm smaller than two checkpoints would fill up at the first
    save; the run says so and trains with its durable checkpoints only."""
    import collections

    import coretrain_local_checkpoint

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(coretrain_local_checkpoint.shutil, "disk_usage", lambda path: usage(10_000, 9_000, 1_000))
    with caplog.at_level("INFO", logger="coretrain"):
        result = run_steps(tmp_path / "run", 8, config=CONFIG, tables=local(tmp_path))
    said = [r.getMessage() for r in caplog.records if "local checkpoints are off" in r.getMessage()]
    assert len(said) == 1 and "has 1 kB free, a local checkpoint of this rank needs about" in said[0], said
    assert not any("non-persistent" in r.getMessage() for r in caplog.records)  # none was even tried
    assert result.exit_code == 0 and steps_in(result.output_dir / "checkpoints") == ["step_00000004", "step_00000008"]


def test_checkpoint_list_names_the_local_folder_a_failed_job_left(tmp_path: Path, cli: Any) -> None:
    folder = failed_at_7(tmp_path, "run")
    listed = cli("checkpoint", "list", str(tmp_path / "run" / "out"), cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert f"local: {folder} holds step(s) 6 (" in listed.stdout
    shutil.rmtree(folder)
    assert "local:" not in cli("checkpoint", "list", str(tmp_path / "run" / "out"), cwd=tmp_path).stdout


class FastTier:
    """A third party's tier of checkpoints, through the core's two seams: ``checkpoint_target``
    says where the saves it asks for go, ``protected_checkpoints`` keeps step 2 from retention.
    ``legacy``: the same tier as a plugin written for hook API 1.12 sets it up."""

    def __init__(self, directory: Path, legacy: bool = False) -> None:
        self.directory, self.legacy = directory, legacy

    @hookimpl
    def configure_run(self, run: Run) -> None:
        if self.legacy:
            run.control.non_persistent_dir = str(self.directory)

    @hookimpl
    def checkpoint_target(self) -> str | None:
        return None if self.legacy else str(self.directory)

    @hookimpl
    def protected_checkpoints(self) -> list[int]:
        return [2]

    @hookimpl
    def post_step(self, run: Run, step: int) -> None:
        run.control.request_checkpoint(persistent=False)


@pytest.mark.parametrize("legacy", [False, True], ids=["checkpoint_target", "non_persistent_dir (1.12)"])
def test_a_plugins_own_tier_gets_the_saves_it_asks_for_and_the_resume_looks_there(tmp_path: Path, legacy: bool) -> None:
    tier = FastTier(tmp_path / "tier", legacy)
    config = {"train": {"log_interval": 1}, "checkpoint": {"save_interval": 2, "keep_last": 1}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps(tmp_path / "run", 7, plugins={"tier": tier}, config=config)
    deprecated = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert any("non_persistent_dir is deprecated" in message for message in deprecated) == legacy
    assert steps_in(tier.directory) == ["step_00000007"]  # every odd step there, only the newest kept
    durable = tmp_path / "run" / "out" / "checkpoints"
    assert steps_in(durable) == ["step_00000002", "step_00000006"]  # keep_last 1, and step 2 protected
    resumed = run_steps(tmp_path / "run", 8, plugins={"tier": FastTier(tier.directory, legacy)}, config=config)
    assert resumed.hooks("post_step") == [8]  # resumed from step 7 (the tier), not 6
