"""Scale-out on CPU with real torchrun and 2 gloo ranks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import (
    config_file,
    free_port,
    gpt_preset,
    in_one_job,
    metrics_rows,
    per_command,
    run_cli,
    run_here,
    run_train,
    start_cli,
    tiny_gpt_config,
    torchrun,
)

pytestmark = pytest.mark.slow  # 2 gloo ranks: the full suite, not the fast tier


def on_torchrun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 -m coretrain ARGS``: the same file under torchrun."""
    return run_cli(*args, cwd=cwd, command=(*torchrun(2), "-m", "coretrain"))


def logged(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r.get("loss", r.get("valid/loss"))) for r in metrics_rows(out)]


def write(directory: Path, name: str, **train: object) -> Path:
    path = directory / f"{name}.toml"
    settings = {
        "micro_batch_size": 4,
        "global_batch_size": 8,
        "train_iters": 20,
        "log_interval": 5,
        "eval_interval": 10,
        **train,
    }
    path.write_text(tiny_gpt_config(directory / name, **settings) + "\n[checkpoint]\nsave_interval = 10\n")
    return path


def test_ddp_on_two_ranks_matches_one_rank_with_two_accumulation_steps(tmp_path: Path) -> None:
    one = run_train(str(write(tmp_path, "one")), cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    two = on_torchrun("run", str(write(tmp_path, "two")), cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    assert "2 rank(s) on cpu" in two.stdout and two.stdout.count("step 20/20") == 1  # only rank 0 draws
    a, b = logged(tmp_path / "one"), logged(tmp_path / "two")
    assert [s for s, _ in a] == [s for s, _ in b]
    assert a[0][1] > 4.5
    for (_, x), (_, y) in zip(a, b):
        assert y == pytest.approx(x, rel=1e-5, abs=1e-5)
    saved = torch.load(tmp_path / "two" / "checkpoints" / "step_00000020" / "model.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in saved)  # unwrapped weights


def test_world_size_that_does_not_divide_the_global_batch_is_a_clear_error(tmp_path: Path) -> None:
    """Said once, by local rank 0, even when it comes to the mistake last: rank 1, started a
    second sooner, left first and torchrun stopped rank 0 before it could say it (seen under load)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, time\nif os.environ.get('LOCAL_RANK') == '0':\n    time.sleep(1)\n"
    )
    config = write(tmp_path, "odd", micro_batch_size=4, global_batch_size=4)
    result = run_cli(
        "run", str(config), cwd=tmp_path, command=(*torchrun(2), "-m", "coretrain"), env={"PYTHONPATH": str(site)}
    )
    assert result.returncode != 0, result.stderr[-3000:]
    assert (
        "error: train.global_batch_size (4) is not a multiple of train.micro_batch_size × data-parallel "
        "size (4 × 2 = 8), and not even one such pass fits in it; lower train.micro_batch_size" in result.stderr
    )
    assert result.stderr.count("error:") == 1  # said once for the job (by local rank 0), not once per rank


def launch_two_ranks_until_step(config: Path, out: Path, step: int) -> subprocess.Popen:
    """`coretrain run --nproc-per-node 2` in the background, returned once metrics.jsonl reaches ``step``."""
    launcher = start_cli("run", str(config), "--nproc-per-node", "2", cwd=config.parent)
    deadline = time.monotonic() + 120
    while launcher.poll() is None and time.monotonic() < deadline:
        if (out / "metrics.jsonl").exists() and any(
            json.loads(line)["step"] >= step
            for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.endswith("}")
        ):  # not a line being written
            break
        time.sleep(0.02)
    return launcher


def saved_by_both_ranks(out: Path) -> int:
    """The latest checkpoint's step, asserting it is the newest complete one and both ranks saved it."""
    step = int((out / "checkpoints" / "latest").read_text())
    complete = sorted(p.name for p in (out / "checkpoints").glob("step_????????"))
    assert complete[-1] == f"step_{step:08d}"
    steps_saved = {
        torch.load(out / "checkpoints" / f"step_{step:08d}" / f"rank_{r:05d}.pt", weights_only=True)["train"]["step"]
        for r in (0, 1)
    }
    assert steps_saved == {step}  # both ranks, same step
    return step


def test_sigterm_to_the_launcher_stops_all_ranks_at_one_step_with_one_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "run"
    process = launch_two_ranks_until_step(write(tmp_path, "run", train_iters=5000, eval_interval=1000), out, 23)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 143, stderr
    step = saved_by_both_ranks(out)
    assert step >= 23 and f"stopping at step {step}: received SIGTERM" in stderr


def test_a_rank_that_fails_with_a_collective_pending_ends_instead_of_hanging(tmp_path: Path, site: Path) -> None:
    """Rank 0 starts an all-reduce rank 1 never joins and raises; rank 1 waits for rank 0's
    process to end. Letting the failed run go destroyed the gloo group through DDP's reducer,
    which joins the group's worker thread — blocked in the collective until rank 1 left — and
    holds the GIL while it does, which the thread needs to let go of the tensor once rank 1 left:
    rank 0 hung for good (one job in four with both ranks failing at one step under load), or,
    when the group's last reference was Python's (the GIL let go), waited for rank 1. The core
    now keeps every group it leaves after a failure and the CLI ends such a process without the
    interpreter's finalization (where a thread that ends a collective aborts the process)."""
    from coretrain.testing import tiny_config, write_config

    plugins = {"pending-collective": {"rank": 0, "at_step": 3}}
    sections = tiny_config(tmp_path / "out", distributed={"backend": "gloo"}, plugins=plugins)
    config = write_config(tmp_path / "c.toml", sections)
    env = {"PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    job = run_cli("run", str(config), "--nproc-per-node", "2", cwd=tmp_path, env=env, timeout=120)
    assert job.returncode == 1, job.stderr[-3000:]
    assert "RuntimeError: pending-collective: raised on rank 0 at step 3" in job.stderr
    # rank 0's own exit ends the job: had it hung, rank 1 would have given up waiting and the
    # launcher would name rank 1. Rank 1's "had ended" line is not asserted: the launcher may
    # stop rank 1 before its next look at rank 0's process (a race by design, lost under load).
    assert "was still running" not in job.stderr, job.stderr[-3000:]
    assert job.stderr.rstrip().endswith("error: rank 0 failed with exit code 1"), job.stderr[-1500:]


def test_a_killed_rank_ends_the_job_and_a_restart_resumes(tmp_path: Path, site: Path) -> None:
    env = {"PYTHONPATH": str(site)}
    config = write(tmp_path, "run", train_iters=30)
    marker = tmp_path / "killed-once"
    config.write_text(config.read_text() + f'\n[plugins.kill-rank]\nrank = 1\nat_step = 15\nmarker = "{marker}"\n')
    # a hang would outlive the collective timeout and fail here (run_cli's timeout), not pass slowly
    failed = run_cli("run", str(config), "--nproc-per-node", "2", cwd=tmp_path, env=env, timeout=240)
    assert failed.returncode == 137 and "error: rank 1 failed with exit code -9" in failed.stderr, failed.stderr
    marker.unlink()
    restarted = run_cli("run", str(config), "--nproc-per-node", "2", "--max-restarts", "1", cwd=tmp_path, env=env)
    assert restarted.returncode == 0, restarted.stderr
    assert "resumed from" in restarted.stderr and "(step 10," in restarted.stderr
    assert logged(tmp_path / "run")[-1][0] == 30


def fsdp_config(directory: Path, name: str) -> Path:
    path = write(directory, name)
    path.write_text(path.read_text() + '\n[distributed]\nstrategy = "fsdp"\n[plugins.model-stats]\n')
    return path


def test_a_global_batch_that_follows_the_ranks_is_said_when_a_resume_on_more_ranks_changes_it(tmp_path: Path) -> None:
    """``train.global_batch_size`` unset: the batch is micro × data-parallel ranks, so the 1-rank
    run's checkpoint resumed on 2 ranks trains on batches twice as large; resume-checks says so,
    with the key that keeps it (the context-parallel test resumes without a change: no word)."""
    preset = gpt_preset(tmp_path / "out")
    config = config_file(tmp_path / "c.toml", preset, micro_batch_size=4, train_iters=2, log_interval=1)
    assert run_train(str(config), cwd=tmp_path).returncode == 0
    job = in_one_job(tmp_path, 2, [["run", str(config), "--set", "train.train_iters=3"]], "grown")
    assert (
        "resuming step 2 with a global batch of 8 (4 × 2 data-parallel rank(s)); it was 4 (4 × 1): "
        "train.global_batch_size is unset, so it follows the ranks. Set train.global_batch_size = 4 (with a "
        "train.micro_batch_size that × 2 divides it) to train on with the batch it had"
    ) in job.stderr
    last = [row for row in metrics_rows(tmp_path / "out") if "consumed_samples" in row][-1]
    assert (last["step"], last["global_batch_size"], last["consumed_samples"]) == (3, 8, 2 * 4 + 8)


SPARE_MODEL = """
import torch
from coretrain.testing import tiny_model

def model():
    net = tiny_model()
    net.spare = torch.nn.Linear(4, 4)  # a head this task never uses: no gradient, ever
    return net
"""


def test_a_parameter_ddp_gets_no_gradient_for_is_one_line_with_the_ddp_key(tmp_path: Path) -> None:
    """DDP's own error tells a user to pass ``find_unused_parameters=True`` to a constructor they
    never call, and lists the parameters by index; the ddp plugin says it with its key and their
    names, and that key makes the same job train."""
    from coretrain.testing import tiny_config, write_config

    (tmp_path / "spare.py").write_text(SPARE_MODEL)
    distributed = {"strategy": "ddp", "backend": "gloo"}
    settings = tiny_config(
        tmp_path / "out", model={"provider": "spare:model"}, train={"train_iters": 3}, distributed=distributed
    )
    config = write_config(tmp_path / "c.toml", settings)
    fails = {"args": ["run", str(config)], "expect": 1}
    fixed = ["run", str(config), "--set", "plugins.ddp.find_unused_parameters=true"]
    job = in_one_job(tmp_path, 2, [fails, fixed], "spare", env={"PYTHONPATH": str(tmp_path)})
    assert (
        "error: the model's parameters spare.weight, spare.bias got no gradient in step 1 (DDP reduces every "
        "parameter's gradient each step): set [plugins.ddp] find_unused_parameters = true"
    ) in job.stderr
    assert "passing the keyword argument `find_unused_parameters=True`" not in job.stderr.split("=== ")[1]
    assert metrics_rows(tmp_path / "out")[-1]["step"] == 3 and "checkpoint step 3 saved" in job.stderr  # trained


def test_fsdp_checkpoint_is_sharded_and_resumes_on_two_ranks_and_on_one(tmp_path: Path) -> None:
    """Saved in the background (``async_save``) by 2 FSDP ranks; resumed on 2 and on 1."""
    split = fsdp_config(tmp_path, "split")
    split.write_text(split.read_text().replace("[checkpoint]\n", "[checkpoint]\nasync_save = true\n"))
    jobs = [  # three jobs' runs in one job
        ["run", str(fsdp_config(tmp_path, "full"))],
        ["run", str(split), "--set", "train.exit_interval=10"],
        ["run", str(split)],
    ]
    job = in_one_job(tmp_path, 2, jobs, "fsdp")
    assert "checkpoint step 10: training blocked" in job.stderr
    checkpoint = tmp_path / "split" / "checkpoints" / "step_00000010"
    assert (checkpoint / "sharded" / ".metadata").is_file() and not (checkpoint / "model.pt").exists()
    assert sorted(p.name for p in (checkpoint / "sharded").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert logged(tmp_path / "split") == logged(tmp_path / "full")  # same world size: exact

    one = tmp_path / "one.toml"
    one.write_text(split.read_text().replace(str(tmp_path / "split"), str(tmp_path / "one")))
    resharded = ("--set", "distributed.strategy=none", "--set", f"checkpoint.resume={json.dumps(str(checkpoint))}")
    one_rank = run_train(str(one), *resharded, cwd=tmp_path)  # resharded by DCP
    assert one_rank.returncode == 0, one_rank.stderr
    assert "resumed from" in one_rank.stderr and "(step 10," in one_rank.stderr
    expected = [(step, loss) for step, loss in logged(tmp_path / "full") if step > 10]
    got = logged(tmp_path / "one")
    assert [step for step, _ in got] == [step for step, _ in expected]
    for (step, loss), (_, reference) in zip(got, expected):
        assert loss == pytest.approx(reference, rel=1e-5), step
    # model-stats sums FSDP's shards: the whole model's norm, as the unsharded run measures it
    norms = [
        [r["params_norm"] for r in metrics_rows(tmp_path / name) if r["step"] > 10 and "params_norm" in r]
        for name in ("one", "full")
    ]
    assert norms[0] and norms[0] == pytest.approx(norms[1], rel=1e-5)

    exported = run_here(
        "checkpoint", "export", str(tmp_path / "split"), "--to", str(tmp_path / "m.safetensors"), cwd=tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file

    assert "wte.weight" in load_file(str(tmp_path / "m.safetensors"))


def test_async_save_on_two_ddp_ranks_resumes_exactly(tmp_path: Path) -> None:
    """(FSDP's sharded async save: test_fsdp_checkpoint_is_sharded_and_resumes_on_two_ranks_and_on_one.)"""
    configs = {}
    for name in ("full", "split"):
        configs[name] = write(tmp_path, name)
        configs[name].write_text(configs[name].read_text() + '\n[distributed]\nstrategy = "ddp"\n')
    async_save = ["--set", "checkpoint.async_save=true"]
    jobs = [  # three jobs' runs in one job
        ["run", str(configs["full"])],
        ["run", str(configs["split"]), *async_save, "--set", "train.exit_interval=10"],
        ["run", str(configs["split"]), *async_save],
    ]
    job = in_one_job(tmp_path, 2, jobs, "ddp")
    assert "checkpoint step 10: training blocked" in job.stderr and "(step 10," in job.stderr
    assert logged(tmp_path / "split") == logged(tmp_path / "full")


def complete_checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_????????"))


def test_a_rank_slowed_by_injected_sleep_is_reported_and_can_stop_the_run(tmp_path: Path) -> None:
    config = write(tmp_path, "run", train_iters=40, eval_iters=0)
    config.write_text(
        config.read_text()
        + """
[distributed]
strategy = "none"
[plugins.fault-injection]
action = "sleep"
step = 1
every_step = true
sleep_seconds = 0.03
ranks = [1]
[plugins.stragglers]
report_interval = 0
warmup_steps = 2
"""
    )
    stop = ["--set", "plugins.stragglers.stop_if_detected=true", "--set", f"run.output_dir={tmp_path / 'stop'}"]
    job = in_one_job(tmp_path, 2, [["run", str(config)], ["run", str(config), *stop]], "stragglers")
    assert "stragglers at step 5: ranks [1] below thresholds" in job.stdout
    rows = metrics_rows(tmp_path / "run")
    assert rows[-1]["step"] == 40 and rows[-1]["stragglers/min_relative_score"] < 0.7
    # requested at step 5 (its log step), agreed by every rank without blocking, acted on at step 6
    assert "stopping at step 6: stragglers: ranks [1] are slow" in job.stderr
    assert complete_checkpoints(tmp_path / "stop") == [6]


def test_weight_hash_names_the_first_parameter_where_replicas_differ(tmp_path: Path, site: Path) -> None:
    config = write(tmp_path, "run", train_iters=20, eval_iters=0)
    config.write_text(config.read_text() + "\n[plugins.weight-hash]\ninterval = 5\n")
    perturbed = tmp_path / "bad.toml"
    perturbed.write_text(config.read_text() + "\n[plugins.perturb-weights]\nrank = 1\nat_step = 7\n")
    bad = ["run", str(perturbed), "--set", f"run.output_dir={json.dumps(str(tmp_path / 'bad'))}"]
    job = in_one_job(
        tmp_path, 2, [["run", str(config)], {"args": bad, "expect": 4}], "hashes", env={"PYTHONPATH": str(site)}
    )
    assert (
        "weight-hash: step 10: replicas differ, first at parameter 'wte.weight' (ranks grouped by value: [[0], [1]])"
    ) in job.stderr
    assert not (tmp_path / "bad" / "checkpoints" / "step_00000010").exists()  # no state to trust


def test_fp8_with_fsdp_all_gather_runs_on_two_ranks_and_tracks_fp32(tmp_path: Path) -> None:
    reference = run_train(str(write(tmp_path, "ref", eval_iters=0)), cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr
    config = write(tmp_path, "fp8", eval_iters=0)
    config.write_text(config.read_text() + '\n[distributed]\nstrategy = "fsdp"\n[plugins.fp8]\nfp8_all_gather = true\n')
    result = in_one_job(tmp_path, 2, [["run", str(config)]], "fp8")
    assert "fp8: tensorwise recipe on 6 Linear layers" in result.stderr
    for (s1, a), (s2, b) in zip(logged(tmp_path / "ref"), logged(tmp_path / "fp8")):
        assert s1 == s2 and b == pytest.approx(a, rel=0.02)


def test_a_nan_only_one_rank_sees_is_skipped_by_both_and_the_replicas_stay_equal(tmp_path: Path, site: Path) -> None:
    config = write(tmp_path, "run", train_iters=20, eval_iters=0)
    config.write_text(
        config.read_text() + "\n[plugins.guards]\n[plugins.weight-hash]\ninterval = 5\n"
        "[plugins.nan-loss]\nrank = 1\nat_step = 7\n"
    )
    result = in_one_job(tmp_path, 2, [["run", str(config)]], "nan", env={"PYTHONPATH": str(site)})  # exit 0: no split
    assert "guards: step 7: loss is nan; update skipped" in result.stderr  # rank 0 judged the mean too
    rows = {r["step"]: r for r in metrics_rows(tmp_path / "run")}
    assert (rows[5]["skipped_updates"], rows[10]["skipped_updates"], rows[20]["skipped_updates"]) == (0.0, 1.0, 1.0)
    assert "replicas differ" not in result.stderr


def test_a_step_only_one_rank_skips_in_pre_step_is_skipped_by_both_without_running(tmp_path: Path, site: Path) -> None:
    """iterations_to_skip's seam: a pre_step veto on one rank skips the whole step on every
    rank (no forward or update anywhere), the replicas stay equal, and the data order holds."""
    config = write(tmp_path, "run", train_iters=10, eval_iters=0)
    config.write_text(
        config.read_text() + "\n[plugins.weight-hash]\ninterval = 5\n[plugins.skip-step]\nrank = 1\nat_step = 4\n"
    )
    result = in_one_job(tmp_path, 2, [["run", str(config)]], "skip", env={"PYTHONPATH": str(site)})
    rows = {r["step"]: r for r in metrics_rows(tmp_path / "run")}
    assert (rows[5]["skipped_updates"], rows[5]["skipped_steps"], rows[10]["skipped_steps"]) == (1.0, 1.0, 0.0)
    assert rows[10]["consumed_samples"] == 80.0  # the skipped step's batch was drawn
    assert "replicas differ" not in result.stderr


def test_a_veto_no_plugin_declared_stops_the_run_naming_the_declaration(tmp_path: Path, site: Path) -> None:
    """Only declared vetoes are agreed (a before_update that only watches costs no collective);
    an undeclared one on one rank would let the replicas drift: it is one error instead."""
    config = write(tmp_path, "run", train_iters=20, eval_iters=0)
    config.write_text(config.read_text() + "\n[plugins.undeclared-veto]\nrank = 1\nat_step = 4\n")
    result = in_one_job(
        tmp_path, 2, [{"args": ["run", str(config)], "expect": 1}], "veto", env={"PYTHONPATH": str(site)}
    )
    assert (
        "step 4: an update was vetoed (undeclared test veto) by one of undeclared-veto, but no enabled plugin "
        "declares coretrain_vetoes_updates = True" in result.stderr
    )


def descendants(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children")
    found = [int(c) for c in children.read_text().split()] if children.exists() else []
    return found + [d for c in found for d in descendants(c)]


def test_a_preempted_job_whose_workers_get_sigterm_twice_still_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "run"
    launcher = launch_two_ranks_until_step(write(tmp_path, "run", train_iters=5000, eval_interval=1000), out, 12)
    workers = [
        p
        for p in descendants(launcher.pid)
        if "coretrain" in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
    ]
    assert len(workers) >= 2
    for pid in workers:  # the scheduler signals every process of the job...
        os.kill(pid, signal.SIGTERM)
    launcher.send_signal(signal.SIGTERM)  # ...and the launcher forwards it to the workers again
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 143, stderr
    assert saved_by_both_ranks(out) >= 12


def test_a_rampup_counted_in_samples_resumes_on_more_ranks_planning_only_the_steps_ahead(tmp_path: Path) -> None:
    """One rank × micro 2 ramps the batch 2, 2, 2, 2, 4, 4, 6, 6, then 8 (rampup [2, 2, 24]) over
    92 samples; stopped after the ramp, it resumes on 2 ranks, where a batch of 2 cannot be
    split (4 samples per pass) — but no step ahead needs one. It was refused (also with
    train.decrease_batch_size_if_needed), because the plan started again at step 1. Its
    validations read the configured global batch, so they are the uninterrupted run's."""

    def config(name: str) -> Path:
        preset = gpt_preset(tmp_path / name)
        del preset["train"]["train_iters"]
        train = {"train_samples": 92, "micro_batch_size": 2, "global_batch_size": 8, "log_interval": 1}
        extra = {"plugins": {"batch-rampup": {"rampup_batch_size": [2, 2, 24]}}}
        return config_file(tmp_path / f"{name}.toml", preset, extra, **train, eval_iters=1, eval_interval=4)

    whole = run_train(str(config("whole")), cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    first = run_train(str(config("grown")), "--set", "train.exit_interval=8", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    in_one_job(tmp_path, 2, [["run", str(config("grown"))]], "grown")
    rows: dict[int, dict[str, float]] = {}
    reference: dict[int, dict[str, float]] = {}
    for merged, name in ((rows, "grown"), (reference, "whole")):  # a step's train and valid rows, merged
        for row in metrics_rows(tmp_path / name):
            merged.setdefault(row["step"], {}).update(row)
    assert sorted(rows) == sorted(reference) == list(range(1, 17))
    assert [rows[step]["global_batch_size"] for step in (4, 5, 8, 9, 16)] == [2, 4, 6, 8, 8]
    for step in range(9, 17):
        assert rows[step]["loss"] == pytest.approx(reference[step]["loss"], rel=1e-6), step
    for step in (12, 16):  # validated on the samples the uninterrupted run's validation read
        assert rows[step]["valid/loss"] == pytest.approx(reference[step]["valid/loss"], rel=1e-6), step


def test_a_job_that_lost_a_rank_goes_on_with_a_smaller_global_batch_only_when_allowed(tmp_path: Path) -> None:
    """2 ranks × micro 2 × 2 accumulation = 8; resumed on 3 ranks, 8 is no multiple of 6."""
    path = write(tmp_path, "run", micro_batch_size=2, global_batch_size=8, eval_iters=0, log_interval=5)
    in_one_job(tmp_path, 2, [["run", str(path), "--set", "train.exit_interval=10"]], "first")
    refused = run_cli("run", str(path), "--nproc-per-node", "3", cwd=tmp_path)  # coretrain's launcher
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
    assert refused.stderr.count("error:") == 1 and "exitcode" not in refused.stderr  # once, by local rank 0
    assert (
        "error: train.global_batch_size (8) is not a multiple of train.micro_batch_size × data-parallel size "
        "(2 × 3 = 6); set train.decrease_batch_size_if_needed = true" in refused.stderr
    )
    allowed = in_one_job(
        tmp_path, 3, [["run", str(path), "--set", "train.decrease_batch_size_if_needed=true"]], "allowed"
    )
    assert allowed.stderr.count("training with a global batch of 6 instead") == 1  # once for the job
    rows = {r["step"]: r for r in metrics_rows(tmp_path / "run")}
    assert (rows[10]["global_batch_size"], rows[15]["global_batch_size"]) == (8.0, 6.0)
    assert rows[20]["consumed_samples"] == 10 * 8 + 10 * 6


def test_an_output_dir_the_nodes_do_not_share_is_one_clear_error(tmp_path: Path) -> None:
    """Two "nodes" on one machine, each in its own working directory: a relative output_dir is
    then two directories, as a node-local disk would be."""
    port = free_port()
    nodes = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        (cwd / "c.toml").write_text(tiny_gpt_config(Path("out"), train_iters=4))
        launch = ("--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}")
        nodes.append(start_cli("run", "c.toml", *launch, cwd=cwd))  # coretrain's launcher, a fixed 2 machines
    outputs = [node.communicate(timeout=180) for node in nodes]
    assert all(node.returncode != 0 for node in nodes)
    message = "is not one directory for every rank: rank 1 on"
    assert message in outputs[1][1] and "checkpoints need a directory all nodes share" in outputs[1][1]
    assert not (tmp_path / "node1" / "out" / "checkpoints").exists()


def test_a_hung_rank_is_named_with_its_step_and_phase_and_the_job_ends(tmp_path: Path) -> None:
    config = write(tmp_path, "run", train_iters=40, eval_iters=0)
    hang = '[plugins.fault-injection]\naction = "hang"\nstep = 6\nranks = [1]\n'
    config.write_text(config.read_text() + "\n[plugins.watchdog]\nstep_timeout_seconds = 3\n" + hang)
    # with no watchdog this would hang until the test's own timeout, not end with an error
    result = on_torchrun("run", str(config), cwd=tmp_path)
    assert result.returncode != 0
    assert "error: rank 1: no progress for 3 s at step 6, last in pre_step" in result.stderr
    assert "hang.rank1.log" in {p.name for p in (tmp_path / "run").iterdir()}


@pytest.mark.slow  # 2 gloo ranks
def test_timers_line_the_ranks_up_at_level_2_and_report_each_ranks_times(tmp_path: Path) -> None:
    """timing_log_level 2 puts a barrier at every phase mark (a rank that waited at one would
    hang the job if the ranks marked phases differently); "all" logs every rank's phase times,
    the slowest under the plain name, and "minmax" the fastest."""
    config = write(tmp_path, "run", train_iters=6, log_interval=3, eval_interval=3)
    timers = '\n[plugins.timers]\ntiming_log_level = 2\ntiming_log_option = "all"\n'
    config.write_text(config.read_text() + timers)
    in_one_job(tmp_path, 2, [["run", str(config)]], "timers")
    rows = [row for row in metrics_rows(tmp_path / "run") if "loss" in row]
    assert [row["step"] for row in rows] == [3, 6]
    for row in rows:
        for phase in ("data", "forward_backward", "optimizer"):
            mine = [row[f"time/{phase}/rank{rank}"] for rank in (0, 1)]
            assert min(mine) > 0 and row[f"time/{phase}"] == max(mine)


@pytest.mark.slow  # one job of 2 gloo ranks, six runs
def test_megatrons_ddp_knobs_by_their_names(tmp_path: Path) -> None:
    """bf16 gradients (master-weights) all-reduced in fp32 by the plugin's comm hook; one bucket
    for every gradient (overlap_grad_reduce = false) or Megatron-sized buckets train the same
    numbers as torch's buckets; average_in_collective on gloo is one error before training."""

    def config(name: str, table: str) -> str:
        path = write(tmp_path, name, train_iters=6, log_interval=2, eval_interval=6)
        path.write_text(path.read_text() + '\n[distributed]\nstrategy = "ddp"\n' + table)
        return str(path)

    bf16 = "[plugins.master-weights]\n"
    configs = {
        "plain": config("plain", ""),
        "fp32": config("fp32", bf16 + "[plugins.ddp]\ngrad_reduce_in_fp32 = true\n"),
        "small": config("small", "[plugins.ddp]\nbucket_cap_mb = 0.01\n"),
        "one": config("one", "[plugins.ddp]\nbucket_cap_mb = 0.01\noverlap_grad_reduce = false\n"),
        "sized": config("sized", "[plugins.ddp]\nbucket_size = 1000\n"),
        "average": config("average", "[plugins.ddp]\naverage_in_collective = true\n"),
    }
    commands: list[Any] = [["run", path] for name, path in configs.items() if name != "average"]
    commands[1] += ["--set", "run.precision=bf16"]
    commands.append({"args": ["run", configs["average"]], "expect": 2})
    said = per_command(in_one_job(tmp_path, 2, commands, "knobs").stderr, list(configs.values()))
    assert "ddp: bfloat16 gradients all-reduced in float32 (grad_reduce_in_fp32)" in said[configs["fp32"]]
    # torch's record of the buckets DDP built: small ones as asked, or one for every gradient
    buckets = [
        int(said[configs[name]].split("gradients all-reduced in ")[1].split(" bucket")[0])
        for name in ("small", "one", "sized")
    ]
    assert buckets[0] > 1 and buckets[1] == 1 and buckets[2] > 1, buckets
    assert logged(tmp_path / "one") == logged(tmp_path / "sized") == logged(tmp_path / "plain")
    assert "plugins.ddp.average_in_collective: gloo has no averaging" in said[configs["average"]]


@pytest.mark.slow  # one job of 2 gloo ranks, four runs
def test_the_distributed_optimizer_shards_the_state_trains_ddps_numbers_and_resumes_anywhere(tmp_path: Path) -> None:
    """use_distributed_optimizer (ZeRO-1, torch's ZeroRedundancyOptimizer): each rank holds about
    half of Adam's state, the losses are DDP's bitwise, the checkpoint holds the whole state
    (gathered to rank 0) and resumes on 2 ranks with it and on 1 rank without."""

    def losses(out: Path) -> list[tuple[int, float]]:
        return [(row["step"], row["loss"]) for row in metrics_rows(out) if "loss" in row]

    def config(name: str, zero: bool) -> str:
        path = write(tmp_path, name, train_iters=8, log_interval=1, eval_interval=8)
        table = f"\n[distributed]\nstrategy = 'ddp'\n[plugins.ddp]\nuse_distributed_optimizer = {str(zero).lower()}\n"
        path.write_text(path.read_text().replace("save_interval = 10", "save_interval = 4") + table)
        return str(path)

    halves = config("halves", True)
    two_ranks = [["run", config("ddp", False)], ["run", config("zero", True)]]
    two_ranks += [["run", halves, "--set", "train.exit_interval=4"], ["run", halves]]  # resumed at step 4
    in_one_job(tmp_path, 2, two_ranks, "two")
    assert logged(tmp_path / "zero") == logged(tmp_path / "ddp")
    whole = torch.load(tmp_path / "zero" / "checkpoints" / "step_00000008" / "optimizer.pt", weights_only=True)
    state_bytes = sum(v.numel() * v.element_size() for s in whole["state"].values() for v in s.values())
    held = [row["optimizer_state_bytes_max"] for row in metrics_rows(tmp_path / "zero") if "loss" in row]
    assert state_bytes / 2 <= held[-1] < 0.75 * state_bytes
    assert losses(tmp_path / "halves") == losses(tmp_path / "ddp")
    start = tmp_path / "halves" / "checkpoints" / "step_00000004"
    in_one_job(
        tmp_path, 1, [["run", config("one", False), "--set", f"checkpoint.resume={json.dumps(str(start))}"]], "one"
    )
    resumed, reference = losses(tmp_path / "one"), dict(losses(tmp_path / "ddp"))
    assert [step for step, _ in resumed] == [5, 6, 7, 8]
    assert [loss for _, loss in resumed] == pytest.approx([reference[step] for step, _ in resumed], rel=1e-5)
