"""Bring your own workload: a classifier that returns logits, a user collate_fn, DataLoader
workers, a model that returns named values, exact evaluation — through the real CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import tomli
import torch
from conftest import config_file, in_one_job, metrics_rows, run_cli, run_here

from coretrain.configload import deep_merge
from coretrain.testing import run_steps

pytestmark = pytest.mark.slow  # user workloads through the CLI and on 2 ranks: the full suite, not the fast tier

TESTS = str(Path(__file__).resolve().parent)
CONSOLE_SCRIPT = (str(Path(sys.executable).parent / "coretrain"),)


def digits_config(
    directory: Path,
    name: str = "run",
    extra: str = "",
    data: str = "",
    model: str = "workloads:cnn",
    loss: str | None = "cross_entropy",
    provider: str = "workloads:digits",
    options: str = "",
    **train_keys: Any,
) -> tuple[Path, Path]:
    """The CNN-on-digits run: a model returning logits, model.loss, a full validation pass.

    ``model`` / ``provider``: other import paths (``loss = None``: the model returns its loss);
    ``data``: more [data] keys and ``options``: [data.options] keys (TOML lines); ``extra``: more tables."""
    out = directory / name
    preset = {
        "run": {"output_dir": str(out), "threads": 1},
        "model": {"provider": model, **({"loss": loss} if loss else {})},
        "data": {"provider": provider},
        "optimizer": {"lr": 0.01},
        "train": {
            "micro_batch_size": 32,
            "train_iters": 30,
            "log_interval": 10,
            "eval_full": True,
            "eval_micro_batch_size": 64,
        },
    }
    tables = tomli.loads(f"[data]\n{data}\n[data.options]\n{options}\n")
    return config_file(directory / f"{name}.toml", deep_merge(preset, tables), extra, **train_keys), out


def run_digits(config: Path, *args: str, here: bool = True) -> subprocess.CompletedProcess:
    """``coretrain run CONFIG ARGS`` with the test workloads importable: in this process, or in a
    subprocess (``here=False``) where the console's own set-up is what is tested."""
    if here:
        return run_here("run", str(config), *args, cwd=config.parent, env={"PYTHONPATH": TESTS})
    return run_cli("run", str(config), *args, cwd=config.parent, env={"PYTHONPATH": TESTS})


class EvalRecorder:
    def __init__(self) -> None:
        self.evals: list[tuple[int, dict[str, float]]] = []
        self.logs: list[dict[str, float]] = []

    from coretrain import hookimpl

    @hookimpl
    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.evals.append((step, dict(metrics)))

    @hookimpl
    def on_log(self, metrics: dict[str, float]) -> None:
        self.logs.append(dict(metrics))


def test_a_classifier_reports_accuracy_over_every_validation_sample_once(tmp_path: Path, no_autoload: None) -> None:
    recorder = EvalRecorder()
    result = run_steps(
        tmp_path,
        steps=20,
        plugins={"recorder": recorder},
        tables={"timers": {"peak_tflops": 1.0}},  # TFLOP/s and MFU
        config={
            "model": {"provider": "workloads:cnn", "loss": "cross_entropy"},
            "data": {"provider": "workloads:digits"},
            "train": {
                "micro_batch_size": 32,
                "log_interval": 10,
                "eval_full": True,
                "eval_micro_batch_size": 64,
                "eval_interval": 10,
            },
        },
    )
    run, code = result.run, result.exit_code
    assert code == 0
    valid_steps = [(step, m) for step, m in recorder.evals if "valid/accuracy" in m]
    test_steps = [(step, m) for step, m in recorder.evals if "test/accuracy" in m]
    assert [s for s, _ in valid_steps] == [10, 20] and [s for s, _ in test_steps] == [20]  # test once, at the end
    model, valid = run.model.eval(), run.datasets.valid
    with torch.no_grad():
        logits = model(valid.images)  # all 359 samples at once, by hand
    accuracy = (logits.argmax(-1) == valid.labels).float().mean().item()
    loss = torch.nn.functional.cross_entropy(logits, valid.labels).item()
    logged = valid_steps[-1][1]
    assert logged["valid/accuracy"] == pytest.approx(accuracy, rel=1e-6) and accuracy > 0.5
    assert logged["valid/loss"] == pytest.approx(loss, rel=1e-5)
    assert "valid/ppl" not in logged  # not a token-level loss
    # FLOPs counted for a model that does not declare them: 3 × the forward's
    assert run.flops_per_sample and recorder.logs[-1]["tflops_per_device"] > 0
    assert recorder.logs[-1]["mfu"] == recorder.logs[-1]["tflops_per_device"] / 1.0
    assert "train/accuracy" in recorder.logs[-1] and "tokens_per_second" not in recorder.logs[-1]


def test_a_full_evaluation_on_two_ranks_equals_one_rank(tmp_path: Path) -> None:
    """The means over samples, and compute_metrics' metrics of the whole split: each rank's
    share gathered and put back in sample order (rank 0 holds samples 0, 2, 4, ...)."""
    metrics = '[plugins.evaluation]\ncompute_metrics = "workloads:corpus_metrics"\n'
    shares = {"eval_interval": 10, "eval_micro_batch_size": 179}  # 180 valid samples on rank 0 (179 + 1), 179 on
    one_config, one = digits_config(tmp_path, "one", metrics, **shares)  # rank 1, which runs one micro-batch uncounted
    two_config, two = digits_config(tmp_path, "two", metrics, micro_batch_size=16, global_batch_size=32, **shares)
    assert run_digits(one_config).returncode == 0
    in_one_job(tmp_path, 2, [["run", str(two_config)]], "two", env={"PYTHONPATH": TESTS})
    evals = [[r for r in metrics_rows(out) if "valid/loss" in r or "test/loss" in r] for out in (one, two)]
    assert [r["step"] for r in evals[0]] == [r["step"] for r in evals[1]] == [10, 20, 30, 30]
    for a, b in zip(*evals):  # 359 valid samples: 180 on rank 0, 179 on rank 1
        for key in ("valid/loss", "valid/accuracy", "test/loss", "test/accuracy", "valid/macro_f1", "test/acc"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        split = "valid" if "valid/loss" in a else "test"
        assert a[f"{split}/samples"] == b[f"{split}/samples"] == (359 if split == "valid" else 201)
        assert a[f"{split}/order"] == b[f"{split}/order"]  # the labels in the same order
        assert b[f"{split}/acc"] == pytest.approx(b[f"{split}/accuracy"], rel=1e-6)


def test_workers_and_a_user_collate_fn_read_the_same_samples_and_resume_exactly(tmp_path: Path) -> None:
    collate = 'collate_fn = "workloads:as_dict"\n'
    plain_config, plain = digits_config(tmp_path, "plain", data=collate + "num_workers = 0")
    worker_config, workers = digits_config(tmp_path, "workers", data=collate + "num_workers = 2")
    assert run_digits(plain_config).returncode == 0
    first = run_digits(worker_config, "--set", "train.exit_interval=15")
    assert first.returncode == 0, first.stderr
    second = run_digits(worker_config)
    assert second.returncode == 0 and "(step 15," in second.stderr, second.stderr
    keys = ("step", "loss", "train/accuracy", "valid/loss", "valid/accuracy", "test/loss")
    logged = [[{k: r[k] for k in keys if k in r} for r in metrics_rows(out)] for out in (plain, workers)]
    assert logged[0] == logged[1] and any("train/accuracy" in r for r in logged[0])  # the same values, exactly
    final = [
        torch.load(out / "checkpoints" / "step_00000030" / "model.pt", weights_only=True) for out in (plain, workers)
    ]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])  # bit for bit


def test_a_model_returning_named_values_has_them_logged_for_train_and_valid(tmp_path: Path) -> None:
    config, out = digits_config(tmp_path, model="workloads:cnn_with_accuracy", loss=None)
    result = run_digits(config)
    assert result.returncode == 0, result.stderr
    rows = metrics_rows(out)
    assert [r["step"] for r in rows if "train/accuracy" in r] == [10, 20, 30]
    final = [r for r in rows if "valid/accuracy" in r]
    assert len(final) == 1 and 0 < final[0]["valid/accuracy"] <= 1 and "valid/ppl" not in final[0]


def test_batch_rampup_with_workers_takes_the_same_batches_as_without(tmp_path: Path) -> None:
    rampup = "\n[plugins.batch-rampup]\nrampup_batch_size = [32, 32, 320]\n"
    configs = {}
    for workers in (0, 2):
        config, out = digits_config(
            tmp_path,
            f"w{workers}",
            extra=rampup,
            data=f"num_workers = {workers}",
            micro_batch_size=32,
            global_batch_size=96,
            eval_full=False,
            eval_iters=0,
            train_iters=12,
            log_interval=1,
        )
        result = run_digits(config)
        assert result.returncode == 0, result.stderr
        configs[workers] = [(r["step"], r["loss"], r["global_batch_size"]) for r in metrics_rows(out)]
    assert configs[0] == configs[2] and {b for _, _, b in configs[0]} == {32.0, 64.0, 96.0}


def test_the_console_script_imports_providers_from_the_current_directory_and_validate_checks_options(
    tmp_path: Path,
) -> None:
    (tmp_path / "mymodel.py").write_text("from workloads import CNN\n\ndef build(width=8):\n    return CNN(width)\n")
    config, out = digits_config(tmp_path, model="mymodel:build", train_iters=2, eval_full=False, eval_iters=0)

    def console(*args: str) -> subprocess.CompletedProcess:  # the console script, not python -m
        return run_cli(*args, cwd=tmp_path, env={"PYTHONPATH": TESTS}, command=CONSOLE_SCRIPT)  # TESTS: workloads

    result = console("run", str(config))
    assert result.returncode == 0, result.stderr
    bad = console("config", "validate", str(config), "--set", "model.options.widht=4")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "model.options: options do not fit mymodel.build" in bad.stderr and "(did you mean 'width'?)" in bad.stderr
    missing = console("config", "validate", str(config), "--set", 'model.provider="nomodule:build"')
    assert missing.returncode == 2 and "model.provider: cannot import 'nomodule:build'" in missing.stderr


@pytest.mark.parametrize(("stateful", "workers"), [(False, 0), (True, 2)])
def test_a_stream_trains_stops_and_resumes_exactly(tmp_path: Path, stateful: bool, workers: int) -> None:
    outs = []
    for name, stop in (("whole", ()), ("split", ("--set", "train.exit_interval=15"))):
        config, out = digits_config(
            tmp_path,
            name,
            provider="workloads:digit_stream",
            data=f"num_workers = {workers}",
            options=f"stateful = {json.dumps(stateful)}",
            eval_interval=15,
        )
        first = run_digits(config, *stop)
        assert first.returncode == 0, first.stderr
        assert ("the train split is a stream, dealt out item by item" in first.stderr) == (workers > 1)
        if stop:
            second = run_digits(config)
            assert second.returncode == 0 and "(step 15," in second.stderr, second.stderr
        outs.append(out)
    keys = ("step", "loss", "train/accuracy", "valid/loss", "valid/accuracy")
    logged = [[{k: r[k] for k in keys if k in r} for r in metrics_rows(out)] for out in outs]
    assert logged[0] == logged[1] and [r["step"] for r in logged[0] if "valid/loss" in r] == [15, 30]
    final = [torch.load(out / "checkpoints" / "step_00000030" / "model.pt", weights_only=True) for out in outs]
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[0])


def test_a_hugging_face_dataset_is_used_directly_and_resumes_exactly(tmp_path: Path) -> None:
    outs = []
    for name, stop in (("whole", ()), ("split", ("--set", "train.exit_interval=15"))):
        config, out = digits_config(tmp_path, name, provider="workloads:hf_digits")
        for args in ((*stop,), ()) if stop else ((),):
            result = run_digits(config, *args)
            assert result.returncode == 0, result.stderr
        outs.append(out)
    rows = [[(r["step"], r.get("loss"), r.get("valid/accuracy")) for r in metrics_rows(out)] for out in outs]
    assert rows[0] == rows[1] and rows[0][-1][2] > 0.5  # dict batches: model(pixels=, labels=)


@pytest.mark.parametrize(
    ("example", "config", "expected"),
    [("classify", "classify.toml", "test loss"), ("custom-data", "lines.toml", "valid loss")],
)
def test_the_bring_your_own_examples_run_from_their_directory(
    tmp_path: Path, example: str, config: str, expected: str
) -> None:
    from conftest import REPO

    directory = tmp_path / example
    import shutil

    shutil.copytree(REPO / "examples" / example, directory)
    sets = ("train.train_iters=20", "train.eval_interval=10", "run.threads=1")  # (its 2 spin on a busy machine)
    args = [arg for value in sets for arg in ("--set", value)]
    result = run_cli("run", config, *args, cwd=directory, command=CONSOLE_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout and "accuracy" in result.stdout


def test_skip_train_evaluates_the_valid_and_test_splits_once_and_saves_nothing(
    tmp_path: Path, no_autoload: None
) -> None:
    recorder = EvalRecorder()
    result = run_steps(
        tmp_path,
        steps=5,
        plugins={"recorder": recorder},
        config={
            "model": {"provider": "workloads:cnn", "loss": "cross_entropy"},
            "data": {"provider": "workloads:digits"},
            "train": {"micro_batch_size": 32, "skip_train": True, "eval_full": True},
        },
    )
    run, code = result.run, result.exit_code
    assert code == 0 and run.state.step == 0 and recorder.logs == []
    assert [sorted(k.split("/")[0] for k in m)[0] for _, m in recorder.evals] == ["valid", "test"]
    assert not list(run.output_dir.glob("checkpoints/step_*"))  # an evaluation changed no weight: nothing saved


def test_an_input_bound_run_logs_its_data_wait_and_says_so_once_per_job(tmp_path: Path) -> None:
    slow_reads: dict[str, Any] = {"options": "delay = 0.002", "train_iters": 12, "log_interval": 4}
    config, out = digits_config(tmp_path, **slow_reads, eval_full=False, eval_iters=0)
    result = run_digits(config)
    assert result.returncode == 0, result.stderr
    rows = metrics_rows(out)
    for row in rows:  # 32 samples x 2 ms read in the loop: most of every step
        assert row["time/data"] > 0.5 * row["time/step"] and row["time/data_max"] == row["time/data"]
        assert 0 < row["time/forward_backward"] < row["time/step"] and row["time/optimizer"] > 0
    assert result.stderr.count("input-bound:") == 1 and "set data.num_workers" in result.stderr
    assert all(" | data " in line for line in result.stdout.splitlines() if line.startswith("step "))
    # on 2 ranks both wait for data, and the warning (the slowest rank's figures) is the job's one line
    two_config, _ = digits_config(tmp_path, "two", **slow_reads, eval_full=False, eval_iters=0)
    job = in_one_job(tmp_path, 2, [["run", str(two_config)]], "two", env={"PYTHONPATH": TESTS})
    assert job.stderr.count("input-bound:") == 1 and "coretrain: input-bound:" in job.stderr, job.stderr  # rank 0's


def test_log_level_quiet_and_a_library_warning_kept_in_run_log_once(tmp_path: Path) -> None:
    """ChattyCNN warns on every forward with stacklevel=2, so the warning names torch's module
    call as its source, as a library's deprecation does: it goes to run.log once, not to the
    console, which says where it went."""
    config, out = digits_config(
        tmp_path, model="workloads:chatty_cnn", train_iters=20, log_interval=5, eval_full=False, eval_iters=0
    )
    normal = run_digits(config, here=False)
    assert normal.returncode == 0, normal.stderr
    assert "ChattyCNN: this argument is deprecated" not in normal.stderr
    assert (out / "run.log").read_text().count("ChattyCNN: this argument is deprecated") == 1  # 20+ forwards
    assert f"1 line(s) from libraries (torch) are in {out / 'run.log'}" in normal.stderr
    assert "checkpoint step 20 saved" in normal.stderr and normal.stdout.count("step ") >= 4
    # (timers' input-bound advice is a warning, which --quiet keeps: a loaded machine gave it)
    no_advice = ("--set", "plugins.timers.input_bound_share=0")
    quiet = run_digits(config, "--quiet", "--set", f"run.output_dir={tmp_path / 'quiet'}", *no_advice, here=False)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout == "" and quiet.stderr == ""
    assert (tmp_path / "quiet" / "run.log").read_text().count("ChattyCNN: this argument is deprecated") == 1
    assert metrics_rows(tmp_path / "quiet")[-1]["step"] == 20  # quiet, not idle
    by_config = run_digits(
        config, "--set", 'run.log_level="warning"', "--set", f"run.output_dir={tmp_path / 'w'}", here=False
    )
    assert by_config.returncode == 0 and by_config.stdout == ""
