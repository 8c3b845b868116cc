"""Logging backends: each one's own files, read back with its own format, hold metrics.jsonl."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import time
import zipfile
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from conftest import in_one_job, metrics_rows, run_cli, start_cli, write_tiny_gpt

pytestmark = pytest.mark.slow  # every logging backend in real CLI runs: the full suite, not the fast tier


def by_name(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in rows:
        for name, value in row.items():
            if name != "step":
                series[name].append((row["step"], value))
    return dict(series)


def start_run(config: Path, cwd: Path) -> subprocess.Popen:
    return start_cli("run", str(config), cwd=cwd)


def wait_for_logged_steps(out: Path, count: int, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        path = out / "metrics.jsonl"
        if path.exists() and sum('"loss"' in line for line in path.read_text().splitlines()) >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"run did not log {count} steps: {process.communicate()}")


def sigterm_after(config: Path, out: Path, intervals: int) -> tuple[int, str]:
    """Start a real run, send it SIGTERM once it has logged ``intervals`` times; (exit code, stderr)."""
    process = start_run(config, config.parent)
    wait_for_logged_steps(out, intervals, process)
    process.send_signal(signal.SIGTERM)  # what SLURM or Kubernetes sends a preempted job
    _, stderr = process.communicate(timeout=120)
    return process.returncode, stderr


def run_to_end(config: Path, *args: str) -> None:
    result = run_cli("run", str(config), *args, cwd=config.parent)
    assert result.returncode == 0, result.stderr


def comet_archive(directory: Path) -> tuple[dict, list[dict]]:
    """The one offline archive in ``directory``: experiment.json and the messages."""
    (archive,) = directory.glob("*.zip")
    with zipfile.ZipFile(archive) as zipped:
        experiment = json.loads(zipped.read("experiment.json"))
        messages = [json.loads(line) for line in zipped.read("messages.json").decode().splitlines()]
    return experiment, messages


def comet_series(messages: list[dict]) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for message in messages:
        if message["type"] == "metric_msg":
            metric = message["payload"]["metric"]
            series[metric["metricName"]].append((metric["step"], metric["metricValue"]))
    return series


def comet_others(messages: list[dict]) -> dict:
    return {m["payload"]["key"]: m["payload"]["value"] for m in messages if m["type"] == "log_other"}


def mlflow_run_of(out: Path) -> tuple[Any, Any]:
    """(client, the one MLflow run) of experiment "tiny" in the run's default SQLite store."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    return client, run


def mlflow_series(client: Any, run: Any) -> dict[str, list[tuple[int, float]]]:
    return {
        name: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        for name in run.data.metrics
    }


def tensorboard_series(out: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    return {name: [(e.step, e.value) for e in events.Scalars(name)] for name in events.Tags()["scalars"]}


def test_comet_offline_archive_is_complete_after_a_real_sigterm(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(
        tmp_path,
        train_iters=100_000,
        log_interval=5,
        eval_interval=10,
        extra='\n[plugins.comet]\noffline = true\ntags = ["sigterm-test"]\n',
    )
    code, stderr = sigterm_after(config, out, 4)
    assert code == 128 + signal.SIGTERM, stderr

    experiment, messages = comet_archive(out / "comet")  # without the handler comet-ml leaves a 22-byte empty zip
    assert experiment["tags"] == ["sigterm-test"]
    logged = comet_series(messages)
    expected = by_name(metrics_rows(out))
    # every metric, every step, the exact floats (comet-ml adds its own sys.* system metrics)
    assert {name: logged[name] for name in expected} == expected
    saved_at = int((out / "checkpoints" / "latest").read_text())  # the graceful path's checkpoint
    assert 20 <= expected["loss"][-1][0] <= saved_at < expected["loss"][-1][0] + 5

    params = {}
    for message in messages:
        if message["type"] == "parameter_msg":  # "param" for a value, "params" for a list
            param = message["payload"].get("param") or message["payload"]["params"]
            params[param["paramName"]] = param["paramValue"]
    assert params["train|train_iters"] == 100_000 and params["model|provider"] == "gpt"
    others = comet_others(messages)
    assert others["outcome"] == "signal" and others["signal"] == "SIGTERM"
    assets = [m["payload"]["additional_params"]["fileName"] for m in messages if m["type"] == "file_upload"]
    assert assets == ["config.toml"]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[plugins.comet]", "plugins.comet: no Comet API key; set COMET_API_KEY"),
        (
            '[plugins.wandb]\nmode = "online"',
            "plugins.wandb: not logged in to W&B; set WANDB_API_KEY, run `wandb login`",
        ),
    ],
)
def test_an_online_backend_without_credentials_is_one_clear_error(tmp_path: Path, table: str, message: str) -> None:
    config, _ = write_tiny_gpt(tmp_path, train_iters=5, extra=f"\n{table}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMET_", "WANDB_"))}
    env["HOME"] = str(tmp_path)  # no ~/.netrc or ~/.comet.config to find
    result = run_cli("run", str(config), cwd=tmp_path, env=env, inherit_env=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr


def test_with_the_signal_handler_off_comet_warns_that_sigterm_loses_its_archive(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(
        tmp_path,
        train_iters=100_000,
        log_interval=5,
        exit_signal_handler=False,
        extra="\n[plugins.comet]\noffline = true\n",
    )
    code, stderr = sigterm_after(config, out, 2)
    assert code == -signal.SIGTERM  # killed, no Python code ran after
    assert "comet: SIGTERM is not handled" in stderr
    (archive,) = (out / "comet").glob("*.zip")
    assert zipfile.ZipFile(archive).namelist() == []  # comet-ml's own behaviour: the data is gone


def test_mlflow_sqlite_store_holds_metrics_jsonl_and_a_resumed_job_continues_the_same_run(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(
        tmp_path,
        train_iters=20,
        log_interval=5,
        eval_interval=10,
        extra='\n[plugins.mlflow]\ntags = { team = "pretraining" }\n',
    )
    run_to_end(config, "--set", "train.exit_interval=10")  # job 1 stops at step 10
    run_to_end(config)  # job 2 resumes to step 20

    client, mlflow_run = mlflow_run_of(out)  # one run across both jobs
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.tags["team"] == "pretraining"
    expected = by_name(metrics_rows(out))
    assert mlflow_series(client, mlflow_run) == expected  # each step once, exact doubles
    assert [step for step, _ in expected["loss"]] == [5, 10, 15, 20]
    params = mlflow_run.data.params
    assert params["train.train_iters"] == "20" and params["model.options.n_embd"] == "32"
    artifacts = Path(mlflow_run.info.artifact_uri.removeprefix("file://"))
    assert "exit_interval = 10" in (artifacts / "config.toml").read_text()  # each job's config
    assert (artifacts / "resumed_at_step_00000010" / "config.toml").read_text() == (out / "config.toml").read_text()


def wandb_records(run_file: Path) -> list:
    """The records of a W&B transaction log (.wandb): LevelDB-style 32 KiB blocks of protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", "not a W&B transaction log"
    block, pos, pending, records = 32768, 7, b"", []
    while True:
        if block - pos % block < 7:  # a block tail too short for a header is padding
            pos += block - pos % block
        if pos + 7 > len(data):
            return records
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk  # FULL/FIRST start, MIDDLE/LAST continue
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)


def wandb_history(out: Path) -> tuple[dict[str, list[tuple[int, float]]], list]:
    """Every offline run dir's history, by metric name; and all records."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)
    records = [r for run_file in sorted(out.glob("wandb/offline-run-*/run-*.wandb")) for r in wandb_records(run_file)]
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            for name, value in items.items():
                if not name.startswith("_"):
                    series[name].append((items["_step"], value))
    return dict(series), records


def test_wandb_offline_run_holds_metrics_jsonl_across_a_sigterm_and_a_resume(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(
        tmp_path,
        train_iters=100_000,
        log_interval=5,
        eval_interval=10,
        extra='\n[plugins.wandb]\nmode = "offline"\ntags = ["resume-test"]\n',
    )
    code, stderr = sigterm_after(config, out, 3)
    assert code == 128 + signal.SIGTERM, stderr
    stopped_at = int((out / "checkpoints" / "latest").read_text())
    end = (stopped_at // 5 + 2) * 5  # two more logged intervals
    run_to_end(config, "--set", f"train.train_iters={end}")

    first, second = sorted(out.glob("wandb/offline-run-*"))
    assert first.name.split("-")[-1] == second.name.split("-")[-1]  # the same W&B run id, continued
    series, records = wandb_history(out)
    expected = by_name(metrics_rows(out))
    assert expected["loss"][-1][0] == end
    assert series == expected
    run_records = [r.run for r in records if r.WhichOneof("record_type") == "run"]  # one per job
    assert [list(r.tags) for r in run_records] == [["resume-test"]] * 2 and run_records[0].display_name == "tiny"
    configs = [{i.key: json.loads(i.value_json) for i in r.config.update} for r in run_records]
    assert [c["train"]["train_iters"] for c in configs] == [100_000, end]  # each job's config
    exits = [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"]
    assert exits == [0, 0]  # both jobs finished their W&B run


ALL_FOUR = (
    '\n[plugins.tensorboard]\n[plugins.mlflow]\n[plugins.wandb]\nmode = "offline"\n'
    "[plugins.comet]\noffline = true\n"
)  # comet last: a test adds to its table


def test_a_crash_still_closes_every_backend_and_marks_the_run_failed(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(
        tmp_path,
        train_iters=20,
        log_interval=5,
        eval_iters=0,
        extra=ALL_FOUR + '[plugins.fault-injection]\naction = "raise"\nstep = 12\n',
    )
    result = run_cli("run", str(config), cwd=tmp_path)
    assert result.returncode == 1 and "fault-injection: raised on rank 0 at step 12" in result.stderr
    assert [step for step, _ in tensorboard_series(out)["loss"]] == [5, 10]
    _, messages = comet_archive(out / "comet")
    assert comet_others(messages)["outcome"] == "error"
    assert [step for step, _ in comet_series(messages)["loss"]] == [5, 10]
    _, mlflow_run = mlflow_run_of(out)
    assert mlflow_run.info.status == "FAILED" and mlflow_run.data.metrics["loss"] == metrics_rows(out)[-1]["loss"]
    series, records = wandb_history(out)
    assert [r.exit.exit_code for r in records if r.WhichOneof("record_type") == "exit"] == [1]
    assert [step for step, _ in series["loss"]] == [5, 10]


def test_all_four_backends_together_each_hold_every_logged_point(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(
        tmp_path,
        train_iters=20,
        log_interval=5,
        eval_interval=10,
        extra=ALL_FOUR + "log_checkpoints = true\n[plugins.model-stats]\n",
    )
    run_to_end(config)
    expected = by_name(metrics_rows(out))
    assert {"params_norm", "zero_grads", "valid/loss", "tokens_per_second"} <= set(expected)

    stored = {"tensorboard": tensorboard_series(out)}
    _, messages = comet_archive(out / "comet")
    uploads = {m["payload"]["additional_params"]["fileName"] for m in messages if m["type"] == "file_upload"}
    assert {"config.toml", "step_00000020/model.pt", "step_00000020/rank_00000.pt"} <= uploads  # log_checkpoints
    stored["comet"] = comet_series(messages)
    stored["mlflow"] = mlflow_series(*mlflow_run_of(out))
    stored["wandb"] = wandb_history(out)[0]
    for backend, series in stored.items():
        for name, points in expected.items():
            assert [step for step, _ in series[name]] == [step for step, _ in points], (backend, name)
            assert [value for _, value in series[name]] == [
                pytest.approx(value, rel=1e-6 if backend == "tensorboard" else 0) for _, value in points
            ], (backend, name)


def test_on_two_ranks_only_rank_0_logs_and_each_backend_holds_one_run(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(tmp_path, train_iters=10, log_interval=5, eval_iters=0, extra=ALL_FOUR)
    in_one_job(tmp_path, 2, [["run", str(config)]], "backends")
    expected = by_name(metrics_rows(out))
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1
    ((_, messages),) = [comet_archive(out / "comet")]  # exactly one archive
    assert comet_others(messages)["world_size"] == 2
    _, mlflow_run = mlflow_run_of(out)
    assert mlflow_run.data.tags["world_size"] == "2" and mlflow_run.data.metrics["loss"] == expected["loss"][-1][1]
    assert len(list(out.glob("wandb/offline-run-*"))) == 1 and wandb_history(out)[0] == expected


SECRET = "sk-not-for-files-7f3a9c"


def every_byte_written(out: Path) -> bytes:
    """Every file of a run's output dir, zip archives (comet's) unpacked."""
    found = b""
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        found += path.read_bytes()
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as zipped:
                found += b"".join(zipped.read(name) for name in zipped.namelist())
    return found


def test_a_credential_in_the_config_lands_in_no_file_log_or_printout(
    tmp_path: Path, cli: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """``plugins.comet.api_key`` (marked secret in the plugin's settings) reaches the plugin and
    nothing else: not config.toml, the manifests, the trackers' parameters, the log or `config
    show`; a resume neither needs it in the manifest nor reports it changed."""
    config, out = write_tiny_gpt(
        tmp_path,
        train_iters=4,
        log_interval=2,
        eval_iters=0,
        extra="\n[checkpoint]\nsave_interval = 2\n[plugins.mlflow]\n"
        f'[plugins.comet]\noffline = true\napi_key = "{SECRET}"\n',
    )
    with caplog.at_level("DEBUG"):
        first = cli("run", str(config), "--set", "train.exit_interval=2", cwd=tmp_path)
        resumed = cli("run", str(config), cwd=tmp_path)
        shown = cli("config", "show", str(config), cwd=tmp_path)
    assert first.returncode == resumed.returncode == shown.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "api_key" not in resumed.stderr
    assert (out / "checkpoints" / "step_00000004" / "checkpoint.json").is_file()
    assert SECRET.encode() not in every_byte_written(out)
    assert all(SECRET not in text for text in (first.stdout + first.stderr, resumed.stderr, shown.stdout, caplog.text))
    assert "api_key" not in shown.stdout
