"""The ``inprocess-restart`` plugin: a rank that raises costs a restart inside the same processes
— the process group re-formed through the launcher's store, the run rebuilt and resumed from the
newest checkpoint — and the run's losses are an uninterrupted run's."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
from conftest import in_one_job, metrics_rows, run_cli, run_train

from coretrain.testing import run_steps, tiny_config, write_config

RESTART = {"inprocess-restart": {"max_restarts": 2}}


def losses(out: Path) -> list[float]:
    return [row["loss"] for row in metrics_rows(out) if "loss" in row]


def test_one_process_restarts_in_place_and_trains_the_losses_of_an_uninterrupted_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = {"train": {"log_interval": 1}, "checkpoint": {"save_interval": 4}}
    written = {"metrics-file": {}}
    whole = run_steps(tmp_path / "whole", 12, config=config, tables=written)
    fault = {"fault-injection": {"action": "raise", "step": 7}}
    with caplog.at_level("WARNING", logger="coretrain"):
        restarted = run_steps(tmp_path / "restarted", 12, config=config, tables={**fault, **RESTART, **written})
    assert restarted.exit_code == 0 and restarted.run.state.step == 12
    # resumed from the checkpoint of step 4, in the same process: steps 5..7 run again, 1..4 do not
    assert restarted.hooks("pre_step") == [1, 2, 3, 4, 5, 6, 7, 5, 6, 7, 8, 9, 10, 11, 12]
    assert restarted.hooks("on_train_start") == [0, 4]
    assert losses(restarted.output_dir) == losses(whole.output_dir)
    said = [r.getMessage() for r in caplog.records if "in-process restart" in r.getMessage()]
    assert said[0].startswith("in-process restart 1/2 after this rank raised at step 7: plugin 'fault-injection'")
    assert said[1].startswith("in-process restart 1: resumed at step 4, ")
    assert [row.get("inprocess_restarts") for row in metrics_rows(restarted.output_dir)][4:12] == [1.0] * 8


BUILDS = """
import gc, json, weakref
from coretrain.testing import tiny_model

BUILT = []


def make_model(log: str):
    gc.collect()
    alive = [model() is not None for model in BUILT]
    with open(log, "a") as f:
        f.write(json.dumps({"alive": alive, "frozen": gc.get_freeze_count()}) + "\\n")
    BUILT.append(weakref.ref(model := tiny_model()))
    return model
"""


@pytest.mark.slow
def test_a_failed_runs_model_is_freed_before_the_next_is_built_while_the_imports_are_frozen(tmp_path: Path) -> None:
    """On a GPU the failed run's model and optimizer must go before the next run's are built, or
    a restart needs twice the memory. A model provider records, at each build, whether the
    models it built before can still be reached after a collection, with the on-by-default
    plugins and many others on (a plugin that keeps the run past ``on_train_end`` keeps its
    model: the progress view and the timers did). ``coretrain run`` freezes what the imports
    made (``gc.freeze``), so leaving the failed run costs milliseconds — and nothing of a run."""
    (tmp_path / "builds.py").write_text(BUILDS)
    plugins = {
        **{"fault-injection": {"action": "raise", "step": 3}, "inprocess-restart": {}},
        **{"local-checkpoint": {"local_dir": str(tmp_path / "shm")}, "stragglers": {}, "weight-hash": {}, "gc": {}},
        **{"guards": {}, "keep-best": {"metric": "valid/loss"}, "early-stopping": {}, "model-stats": {}},
        **{"deterministic": {}, "batch-rampup": {"rampup_batch_size": [8, 8, 16]}},
    }
    model = {"provider": "builds:make_model", "options": {"log": str(tmp_path / "builds.jsonl")}}
    train = {"train_iters": 6, "eval_interval": 2, "global_batch_size": 16}
    sections = tiny_config(tmp_path / "out", model=model, train=train, checkpoint={"save_interval": 2}, plugins=plugins)
    job = run_cli(
        "run", str(write_config(tmp_path / "c.toml", sections)), cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}
    )
    assert job.returncode == 0, job.stderr[-3000:]
    assert "in-process restart 1: resumed at step 2" in job.stderr
    builds = [json.loads(line) for line in (tmp_path / "builds.jsonl").read_text().splitlines()]
    assert [build["alive"] for build in builds] == [[], [False]]
    assert builds[0]["frozen"] > 100_000  # torch's and torch._dynamo's objects


def test_a_fault_at_every_run_of_a_step_ends_the_run_once_the_restarts_are_used(tmp_path: Path) -> None:
    fault = {"fault-injection": {"action": "raise", "step": 3, "times": 5}}
    with pytest.raises(Exception, match="fault-injection: raised on rank 0 at step 3"):
        run_steps(tmp_path, 6, config={"checkpoint": {"save_interval": 2}}, tables={**fault, **RESTART})


def test_a_mistake_to_fix_is_not_restarted(tmp_path: Path) -> None:
    """A UserError (a mistake in the config or the data) would be made again: it ends the run at once."""
    from coretrain import UserError, hookimpl

    class Mistaken:
        calls = 0

        @hookimpl
        def pre_step(self, step: int) -> None:
            if step == 3:
                Mistaken.calls += 1
                raise UserError("data.options.path: no such file")

    with pytest.raises(UserError, match="no such file"):
        run_steps(tmp_path, 6, plugins={"mistaken": Mistaken()}, tables=RESTART)
    assert Mistaken.calls == 1


def config(tmp_path: Path, name: str, **plugins: Any) -> str:
    sections = tiny_config(
        tmp_path / name,
        train={"train_iters": 12, "log_interval": 1},
        checkpoint={"save_interval": 4},
        distributed={"backend": "gloo"},
        plugins=plugins,
    )
    return str(write_config(tmp_path / f"{name}.toml", sections))


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["coretrain", "torchrun"])
def test_a_rank_that_raises_costs_an_in_process_restart_on_two_gloo_ranks(
    tmp_path: Path, launcher: str, uninterrupted_losses: list[float]
) -> None:
    """The issue's check: ``action = "raise", step = 8, ranks = [1]`` with ``[plugins.inprocess-restart]``
    completes with exit 0 on 2 ranks, says so, and logs the losses of an uninterrupted run. Rank 0
    is blocked in DDP's gradient all-reduce when rank 1 raises: it fails at once (rank 1 shuts its
    gloo connections down), both form a new group and resume from step 4 — under coretrain's
    launcher (rank 0 serves the store) and under torchrun's agent store."""
    fault = {"action": "raise", "step": 8, "ranks": [1]}
    restarted = config(tmp_path, "restarted", **{"fault-injection": fault, **RESTART})
    if launcher == "coretrain":
        job = run_train(restarted, "--nproc-per-node", "2", cwd=tmp_path, env={"OMP_NUM_THREADS": "1"})
        assert job.returncode == 0, job.stderr[-3000:]
    else:
        job = in_one_job(tmp_path, 2, [["run", restarted]], "restart", env={"OMP_NUM_THREADS": "1"}, agent=True)
    assert losses(tmp_path / "restarted") == uninterrupted_losses
    assert "in-process restart 1/2 after rank 1 raised at step 8: plugin 'fault-injection' in pre_step" in job.stderr
    assert "in-process restart 1: resumed at step 4, " in job.stderr


@pytest.mark.slow
def test_a_rank_its_peers_failure_cannot_reach_ends_its_process_and_the_launcher_restarts_the_job(
    tmp_path: Path, site: Path, uninterrupted_losses: list[float]
) -> None:
    """Rank 1 raises at step 6 while rank 0 is stalled there (in a hook that never returns, as a
    gloo receive its peers' cut connections do not end): rank 1 begins the restart, rank 0 ends
    its process ``stuck_seconds`` later, naming why, and ``--max-restarts 1`` runs the job again,
    which completes with the losses of an uninterrupted run — not the watchdog's 300 s later."""
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(site)}
    plugins = {
        "fault-injection": {"action": "raise", "step": 6, "ranks": [1], "attempt": 0},
        "stall": {"rank": 0, "at_step": 6},
        "inprocess-restart": {"stuck_seconds": 2.0},
    }
    stalled = config(tmp_path, "stalled", **plugins)
    job = run_train(stalled, "--nproc-per-node", "2", "--max-restarts", "1", cwd=tmp_path, env=env)
    assert job.returncode == 0, job.stderr[-3000:]
    assert "rank 0: the other ranks began an in-process restart 2 s ago, but this rank is still at step 6" in job.stderr
    assert losses(tmp_path / "stalled") == uninterrupted_losses


def fired_at(plugin: Any, steps: list[int]) -> list[int]:
    """The steps at which ``plugin`` (a sleep of 0 s) fired, its pre_step called as the loop calls it."""
    run = types.SimpleNamespace(dist=types.SimpleNamespace(rank=0))
    fired = []
    for step in steps:
        before = plugin._fired
        plugin.pre_step(run=run, step=step)
        fired += [step] if plugin._fired > before else []
    return fired


def test_a_fault_fires_once_per_process_at_its_step_and_only_in_its_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    from coretrain_fault_injection import FaultInjection

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    # step 3 run again (after an in-process restart, from a checkpoint at 2) does not fire again
    assert fired_at(FaultInjection(action="sleep", step=3, sleep_seconds=0.0), [1, 2, 3, 4, 3, 4]) == [3]
    assert fired_at(FaultInjection(action="sleep", step=3, times=2, sleep_seconds=0.0), [3, 3, 3]) == [3, 3]
    in_second = FaultInjection(action="sleep", step=3, attempt=1, sleep_seconds=0.0)
    assert fired_at(in_second, [3]) == []  # the job's first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert fired_at(in_second, [3]) == [3]
