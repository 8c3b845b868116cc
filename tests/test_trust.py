"""Trust: nothing runs from a checkpoint, one run per directory, resumes that do what they say.

Crafted files, locks, signals and a real file-size limit from the kernel go through the real
CLI in a subprocess; refusals and resumes that only read and write files run the same
``coretrain run`` in-process (``run_here``), as the CLI's error-message tests should.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import metrics_rows, run_cli, run_here, start_cli, write_tiny_gpt

from coretrain.testing import tiny_config, write_config

pytestmark = pytest.mark.slow  # crafted files, signals and locks through the CLI: the full suite, not the fast tier

CKPT = Path("checkpoints")


def step_dir(out: Path, step: int) -> Path:
    return out / CKPT / f"step_{step:08d}"


def one_error_line(stderr: str) -> str:
    """The one `error:` message of a refused run (a config's problems are listed below it); no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("error:")]
    assert len(starts) == 1, stderr
    message = [lines[starts[0]]] + [line.strip() for line in lines[starts[0] + 1 :] if line.startswith("  ")]
    return " ".join(message)


# --------------------------------------------------------------------------- 1. nothing executes


class Payload:
    """Unpickling this creates a file: what a crafted checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path) -> None:
    """Replace ``path`` with a file of the same kind whose loading would run the payload."""
    name = path.name
    if name == ".metadata" or name.endswith(".json"):
        path.write_bytes(pickle.dumps(Payload(marker)))
    elif name.endswith(".distcp"):
        return  # made by make_sharded with the payload inside
    else:
        torch.save({"weights": Payload(marker)}, path)


def make_sharded(step: Path, marker: Path | None) -> None:
    """Rewrite a checkpoint as DCP writes it for FSDP (``sharded/``), optionally with a payload
    as a non-tensor item (the optimizer's param-group values are stored that way)."""
    import torch.distributed.checkpoint as dcp

    model = torch.load(step / "model.pt", weights_only=True)
    optimizer = torch.load(step / "optimizer.pt", weights_only=True)
    names = list(model)
    state = {
        "model": model,
        "optimizer": {
            "state": {names[i]: s for i, s in optimizer["state"].items() if i < len(names)},
            "param_groups": [
                {**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]}
                for g in optimizer["param_groups"]
            ],
        },
    }
    if marker is not None:
        state["optimizer"]["param_groups"][0]["lr"] = Payload(marker)
    dcp.save(state, checkpoint_id=str(step / "sharded"), no_dist=True)
    (step / "model.pt").unlink()
    (step / "optimizer.pt").unlink()
    manifest = json.loads((step / "checkpoint.json").read_text())
    (step / "checkpoint.json").write_text(json.dumps({**manifest, "layout": "sharded"}))


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run that saved one checkpoint, at step 4."""
    directory = tmp_path_factory.mktemp("finished")
    # one param group: make_sharded names the optimizer's states by the model's parameter order
    groups = "\n[plugins.optimizer-overrides]\nenabled = false\n"
    config, out = write_tiny_gpt(directory, train_iters=4, log_interval=2, eval_iters=0, extra=groups)
    result = run_cli("run", str(config), cwd=directory)
    assert result.returncode == 0, result.stderr
    return directory


CASES = [  # (file holding the payload, layout, where the checkpoint is read)
    *[
        (f, "replicated", path)
        for f in ("model.pt", "optimizer.pt", "rank_00000.pt", "checkpoint.json")
        for path in ("resume", "pretrained", "export")
        if not (path != "resume" and f in ("optimizer.pt", "rank_00000.pt"))
    ],
    *[
        (f, "sharded", path)
        for f in ("sharded/.metadata", "sharded/__0_0.distcp")
        for path in ("resume", "pretrained", "export")
        if not (path == "pretrained" and f.endswith(".distcp"))
    ],
    ("model.pt", "replicated", "pretrained file"),  # a file, read by the script-weights plugin first
]


@pytest.mark.parametrize(("planted", "layout", "path"), CASES)
def test_a_crafted_checkpoint_file_runs_nothing_and_is_named(
    tmp_path: Path, finished: Path, planted: str, layout: str, path: str
) -> None:
    work = tmp_path / "w"
    shutil.copytree(finished, work)
    out, marker = work / "out", tmp_path / "PWNED"
    step = step_dir(out, 4)
    if layout == "sharded":
        make_sharded(step, marker if planted.endswith(".distcp") else None)
    target = step / planted
    plant(target, marker)
    config = work / "c.toml"
    config.write_text(config.read_text().replace(str(finished), str(work)))
    if path == "resume":
        result = run_here("run", str(config), "--set", "train.train_iters=6", cwd=work)
    elif path.startswith("pretrained"):
        named_path = target if path == "pretrained file" else step
        result = run_here(
            "run",
            str(config),
            "--set",
            f"run.output_dir={tmp_path / 'new'}",
            "--set",
            f'checkpoint.pretrained="{named_path}"',
            cwd=work,
        )
    else:
        result = run_here("checkpoint", "export", str(out), "--to", str(tmp_path / "m.safetensors"), cwd=work)
    assert not marker.exists(), "the payload ran"
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    named = target if not planted.endswith(".distcp") else step / "sharded"
    assert str(named) in line, line


def test_a_real_sharded_checkpoint_still_loads_through_the_restricted_readers(tmp_path: Path, finished: Path) -> None:
    work = tmp_path / "w"
    shutil.copytree(finished, work)
    make_sharded(step_dir(work / "out", 4), None)
    config = work / "c.toml"
    config.write_text(config.read_text().replace(str(finished), str(work)))
    resumed = run_cli("run", str(config), "--set", "train.train_iters=6", cwd=work)
    assert resumed.returncode == 0, resumed.stderr
    assert "(step 4," in resumed.stderr
    exported = run_cli(
        "checkpoint", "export", str(work / "out"), "--step", "4", "--to", str(tmp_path / "m.st"), cwd=work
    )
    assert exported.returncode == 0, exported.stderr


def test_a_crafted_meta_pkl_beside_the_token_files_runs_nothing_and_is_named(tmp_path: Path) -> None:
    """nanoGPT's meta.pkl is read beside train.bin without being named (as its sample.py finds it):
    read as data, a pickle that calls a function is refused, in training as in predict."""
    marker = tmp_path / "PWNED"
    (tmp_path / "train.bin").write_bytes(bytes(range(64)) * 64)
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"itos": {0: "a"}, "stoi": Payload(marker)}))
    options = {"train_path": str(tmp_path / "train.bin"), "seq_length": 8, "dtype": "uint16"}
    config = tmp_path / "c.toml"
    write_config(config, tiny_config(tmp_path / "out", data={"provider": "token-file", "options": options}))
    result = run_here("run", str(config), cwd=tmp_path)
    assert not marker.exists(), "the payload ran"
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert f"{tmp_path / 'meta.pkl'}: not read as nanoGPT's meta.pkl: it names posix.system" in line, line


# --------------------------------------------------------------------------- 2. one run per directory


def wait_for(predicate: Any, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"condition not reached; exit code {process.poll()}")


def logged_step(out: Path, step: int) -> Any:
    def reached() -> bool:
        path = out / "metrics.jsonl"
        return path.exists() and any(
            json.loads(line)["step"] >= step for line in path.read_text().splitlines() if line.endswith("}")
        )

    return reached


def test_a_second_run_on_a_directory_in_use_is_refused_until_the_first_dies(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(tmp_path, train_iters=100000, log_interval=2, eval_iters=0)
    first = start_cli("run", str(config), cwd=tmp_path)
    try:
        wait_for(logged_step(out, 2), first)
        second = run_here(  # another process's lock: this one may be the test's own
            "run", str(config), "--set", "optimizer.lr=0.01", "--set", "train.train_iters=10", cwd=tmp_path
        )
        assert second.returncode == 2
        line = one_error_line(second.stderr)
        assert line.startswith(f"error: {out} is in use by pid {first.pid} on {socket.gethostname()} since ")
        assert not (out / CKPT).exists()  # the refused run wrote nothing
    finally:
        first.kill()
        first.wait()
    after = run_here("run", str(config), "--set", "train.train_iters=4", cwd=tmp_path)  # SIGKILL freed the lock
    assert after.returncode == 0, after.stderr


def test_deleting_the_lock_file_of_a_live_run_does_not_let_a_second_run_in(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(tmp_path, train_iters=100000, log_interval=2, eval_iters=0)
    first = start_cli("run", str(config), cwd=tmp_path)
    try:
        wait_for(logged_step(out, 2), first)
        (out / ".lock").unlink()  # a stray `rm`, a cleanup script
        second = run_here("run", str(config), "--set", "train.train_iters=10", cwd=tmp_path)
        assert second.returncode == 2, second.stderr
        line = one_error_line(second.stderr)
        assert line.startswith(f"error: {out} is in use by "), line
        assert first.poll() is None  # the first run goes on, alone
        assert not (out / CKPT).exists()
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 128 + signal.SIGTERM
    steps = [row["step"] for row in metrics_rows(out)]
    assert steps == sorted(set(steps))  # one run's rows, never two runs interleaved


# --------------------------------------------------------------------------- 3. a resume uses the config it is given


def test_resume_uses_and_logs_the_new_optimizer_settings(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(
        tmp_path, train_iters=20, log_interval=5, eval_iters=0, extra='\n[scheduler]\ndecay_style = "constant"\n'
    )
    first = run_here("run", str(config), "--set", "train.exit_interval=10", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    changed = (
        "--set",
        "optimizer.lr=0.01",
        "--set",
        "optimizer.betas=[0.8, 0.95]",
        "--set",
        "optimizer.weight_decay=0.2",
    )
    second = run_here("run", str(config), *changed, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    warnings = [line for line in second.stderr.splitlines() if "changed settings" in line]
    assert len(warnings) == 1
    for fragment in (
        "optimizer.lr 0.003 -> 0.01",
        "optimizer.betas [0.9, 0.999] -> [0.8, 0.95]",
        "optimizer.weight_decay 0.01 -> 0.2",
    ):
        assert fragment in warnings[0]
    groups = torch.load(step_dir(out, 20) / "optimizer.pt", weights_only=True)["param_groups"]
    assert all((g["lr"], tuple(g["betas"])) == (0.01, (0.8, 0.95)) for g in groups)
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.2]  # biases and norms keep none
    assert [r["lr"] for r in metrics_rows(out)] == [0.003, 0.003, 0.01, 0.01]
    saved = json.loads((step_dir(out, 20) / "checkpoint.json").read_text())["config"]["optimizer"]
    assert (saved["lr"], saved["betas"], saved["weight_decay"]) == (0.01, [0.8, 0.95], 0.2)


def test_resume_refuses_a_changed_model_shape_seq_length_or_optimizer_class(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(tmp_path, train_iters=20, log_interval=5, eval_iters=0)
    assert run_here("run", str(config), "--set", "train.exit_interval=5", cwd=tmp_path).returncode == 0

    wider = run_here("run", str(config), "--set", "model.options.n_embd=64", cwd=tmp_path)
    assert wider.returncode == 2
    line = one_error_line(wider.stderr)
    assert "would change what it means: model.options.n_embd 32 -> 64" in line
    assert '[plugins.resume-checks] allow_changes = ["model.options.n_embd"]' in line
    forced = run_here(
        "run",
        str(config),
        "--set",
        "model.options.n_embd=64",
        "--set",
        'checkpoint.allow_changes=["model"]',
        cwd=tmp_path,
    )
    assert forced.returncode == 2
    line = one_error_line(forced.stderr)
    assert (
        "does not fit the model" in line
        and "'wte.weight' has shape [256, 32] in the checkpoint, [256, 64] now" in line
        and "model.options.n_embd (32 -> 64)" in line
    )

    longer = run_here("run", str(config), "--set", "data.options.seq_length=64", cwd=tmp_path)
    assert longer.returncode == 2
    line = one_error_line(longer.stderr)
    assert "would change what it means: data.options.seq_length 32 -> 64: the data position counts" in line
    assert "seq_length 32 -> 64: the data position and the model depend on it" in line

    sgd = run_here("run", str(config), "--set", 'optimizer.name="sgd"', cwd=tmp_path)
    assert sgd.returncode == 2
    assert "optimizer.name: the checkpoint was trained with 'adamw', the config asks for 'sgd'" in one_error_line(
        sgd.stderr
    )
    fresh = run_here(
        "run", str(config), "--set", 'optimizer.name="sgd"', "--set", "checkpoint.load_optimizer=false", cwd=tmp_path
    )
    assert fresh.returncode == 0, fresh.stderr
    assert "(step 5," in fresh.stderr and metrics_rows(out)[-1]["step"] == 20


# --------------------------------------------------------------------------- 4. nothing blocks a restart, nothing twice


def test_a_torn_metrics_line_is_dropped_and_a_rerun_of_a_finished_run_adds_no_rows(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(
        tmp_path, train_iters=20, log_interval=5, eval_interval=10, extra="\n[checkpoint]\nsave_interval = 10\n"
    )
    assert run_here("run", str(config), "--set", "train.exit_interval=15", cwd=tmp_path).returncode == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 16, "loss": 2.5')  # a write cut short
    with open(out / "progress.txt", "a") as f:
        f.write("2026-01-01 00:00:00\tjob x\tworld 1\tstep 17\tcheckp")
    resumed = run_here("run", str(config), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "dropped 1 unreadable line(s)" in resumed.stderr
    rows = metrics_rows(out)
    keys = [(r["step"], "valid/loss" in r) for r in rows]
    assert keys == [(5, False), (10, False), (10, True), (15, False), (20, False), (20, True)]
    progress = (out / "progress.txt").read_text()
    assert progress.endswith("\n") and "checkp\n" not in progress and "step 17" not in progress

    before = ((out / "metrics.jsonl").read_text(), (out / "progress.txt").read_text().count("checkpoint"))
    again = run_here("run", str(config), cwd=tmp_path)  # already finished: adds nothing
    assert again.returncode == 0, again.stderr
    assert ((out / "metrics.jsonl").read_text(), (out / "progress.txt").read_text().count("checkpoint")) == before


def limit_file_size(megabytes: int) -> Any:
    def apply() -> None:  # in the child: a write past the limit fails with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (megabytes * 2**20, megabytes * 2**20))

    return apply


def test_a_save_that_cannot_be_written_is_one_error_and_keeps_the_previous_checkpoint(
    tmp_path: Path, site: Path
) -> None:
    config, out = write_tiny_gpt(
        tmp_path,
        train_iters=30,
        log_interval=5,
        eval_iters=0,
        extra="\n[checkpoint]\nsave_interval = 10\n[plugins.misbehave]\n"
        'at_step = 20\nstate = "big"\nbig_megabytes = 8\n',
    )
    result = run_cli("run", str(config), cwd=tmp_path, env={"PYTHONPATH": str(site)}, preexec_fn=limit_file_size(4))
    assert result.returncode == 1, result.stderr
    line = one_error_line(result.stderr)
    assert line.startswith("error: checkpoint step 20: cannot write (File too large: ") and "rank_00000.pt)" in line
    assert line.endswith("the newest complete checkpoint (step 10) is untouched")
    assert sorted(p.name for p in (out / CKPT).iterdir()) == ["latest", "step_00000010"]
    assert torch.load(step_dir(out, 10) / "model.pt", weights_only=True)
    resumed = run_here(
        "run", str(config), "--set", "plugins.misbehave.enabled=false", cwd=tmp_path, env={"PYTHONPATH": str(site)}
    )
    assert resumed.returncode == 0 and "(step 10," in resumed.stderr


# --------------------------------------------------------------------------- 5. fail before training


def test_a_validation_split_shorter_than_a_batch_fails_before_training(tmp_path: Path) -> None:
    from coretrain_token_file import write_tokens

    write_tokens(str(tmp_path / "train.bin"), [i % 50 for i in range(5000)])
    write_tokens(str(tmp_path / "valid.bin"), list(range(20)))  # shorter than one sample
    config = tmp_path / "c.toml"
    config.write_text(
        write_tiny_gpt(tmp_path)[0]
        .read_text()
        .replace('provider = "text-bytes"', 'provider = "token-file"')
        .split("[data.options]")[0]
        + f'[data.options]\ntrain_path = "{tmp_path / "train.bin"}"\n'
        f'valid_path = "{tmp_path / "valid.bin"}"\nseq_length = 32\n[train]\nmicro_batch_size = 8\n'
        f"train_iters = 10\neval_iters = 2\n"
    )
    result = run_here("run", str(config), cwd=tmp_path)
    assert result.returncode == 2
    assert "the valid split has 0 sample(s), fewer than 8 (one global batch" in one_error_line(result.stderr)
    assert not (tmp_path / "out" / "metrics.jsonl").exists() and not (tmp_path / "out" / CKPT).exists()


def test_the_final_checkpoint_is_saved_before_the_final_validation(tmp_path: Path, no_autoload: None) -> None:
    from helpers_inprocess import config, train

    calls = {"n": 0}

    class BreaksInFinalValidation:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __len__(self) -> int:
            return len(self.inner)

        def __getitem__(self, i: int) -> Any:
            calls["n"] += 1
            if calls["n"] > 20:  # past the start-up check
                raise OSError("the network filesystem went away")
            return self.inner[i]

    import helpers_inprocess

    original = helpers_inprocess.make_data

    def make_data(context: Any) -> Any:
        datasets = original(context)
        datasets.valid = BreaksInFinalValidation(datasets.valid)
        return datasets

    helpers_inprocess.make_data = make_data
    try:
        from coretrain.errors import PluginError

        with pytest.raises(PluginError, match="plugin 'evaluation' failed in evaluate at step 6: OSError: .*went away"):
            train(config(tmp_path, train={"train_iters": 6, "eval_iters": 4}))
    finally:
        helpers_inprocess.make_data = original
    assert (tmp_path / "out" / CKPT / "step_00000006" / "model.pt").is_file()  # the trained weights survived


# ----------------------------------------------------------------------- 6, 7. plugins: state checked, failures named


def test_a_plugin_state_no_run_could_load_is_refused_at_save_naming_the_plugin(tmp_path: Path, site: Path) -> None:
    config, out = write_tiny_gpt(
        tmp_path,
        train_iters=20,
        log_interval=5,
        eval_iters=0,
        extra='\n[checkpoint]\nsave_interval = 5\n[plugins.misbehave]\nat_step = 10\nstate = "path"\n',
    )
    env = {"PYTHONPATH": str(site)}
    result = run_here("run", str(config), cwd=tmp_path, env=env)
    assert result.returncode == 1
    assert one_error_line(result.stderr).startswith(
        "error: plugin 'misbehave' failed in on_checkpoint at step 10: TypeError: returned state['where'] is a "
        "pathlib.PosixPath; a checkpoint holds tensors, numbers, str, bool, None and lists/dicts of these"
    )
    assert sorted(p.name for p in (out / CKPT).glob("step_*")) == ["step_00000005"]
    resumed = run_here("run", str(config), "--set", "plugins.misbehave.enabled=false", cwd=tmp_path, env=env)
    assert resumed.returncode == 0 and "(step 5," in resumed.stderr


def test_a_failing_hook_is_named_contained_and_every_backend_closes(tmp_path: Path, site: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, out = write_tiny_gpt(
        tmp_path,
        train_iters=20,
        log_interval=5,
        eval_iters=0,
        extra="\n[checkpoint]\nsave_interval = 5\n[plugins.tensorboard]\n"
        '[plugins.misbehave]\nraise_in = "on_log"\nat_step = 10\n',
    )
    env = {"PYTHONPATH": str(site)}
    result = run_cli("run", str(config), cwd=tmp_path, env=env)
    assert result.returncode == 1
    assert one_error_line(result.stderr) == (
        "error: plugin 'misbehave' failed in on_log at step 10: ValueError: "
        f"misbehave: deliberate failure in on_log full traceback: {out}/traceback.log"
    )
    assert f"full traceback: {out / 'traceback.log'}" in result.stderr
    assert "Traceback (most recent call last)" in (out / "traceback.log").read_text()
    assert (step_dir(out, 5) / "model.pt").is_file()
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [5]  # closed, so flushed

    # one plugin raising in on_train_end: the others' on_train_end still run, backends close
    shutil.rmtree(out)
    ending = run_cli(
        "run", str(config), "--set", 'plugins.misbehave.raise_in="on_train_end"', "--traceback", cwd=tmp_path, env=env
    )
    assert ending.returncode == 1
    assert "error: plugin 'misbehave' failed in on_train_end at step 20: ValueError" in ending.stderr
    assert "Traceback (most recent call last)" in ending.stderr  # --traceback prints it too
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [5, 10, 15, 20]
    assert metrics_rows(out)[-1]["step"] == 20


# --------------------------------------------------------------------------- 8. corrupt newest falls back


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(
        tmp_path, train_iters=20, log_interval=5, eval_iters=0, extra="\n[checkpoint]\nsave_interval = 5\n"
    )
    assert run_here("run", str(config), "--set", "train.exit_interval=15", cwd=tmp_path).returncode == 0
    model = step_dir(out, 15) / "model.pt"
    model.write_bytes(model.read_bytes()[:1000])  # torn by a bad disk
    result = run_here("run", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    warning = next(line for line in result.stderr.splitlines() if "falling back" in line)
    assert (
        f"{step_dir(out, 15) / 'model.pt'}: cannot load checkpoint file: RuntimeError: PytorchStreamReader "
        "failed reading zip archive" in warning
    )
    assert "(step 10," in result.stderr
    assert [r["step"] for r in metrics_rows(out)] == [5, 10, 15, 20]


def test_a_manifest_is_measured_for_nesting_without_parsing_it(tmp_path: Path) -> None:
    """Brackets inside strings (escaped quotes too) do not count; 32 levels read, 33 do not."""
    from coretrain.checkpoint.layout import MAX_NESTING, nesting, read_manifest
    from coretrain.errors import CheckpointUnreadable

    assert nesting('{"a": [1, {"b": "[[[{"}], "c": "x\\"[{", "d": {}}') == 3
    assert nesting("[]") == 1 and nesting('"[["') == 0 and nesting("[" * 40 + "]" * 40) == 40
    for levels in (MAX_NESTING, MAX_NESTING + 1):  # the manifest, its config table, lists in it
        directory = tmp_path / str(levels)
        directory.mkdir()
        lists = "[" * (levels - 2) + "]" * (levels - 2)
        (directory / "checkpoint.json").write_text(f'{{"layout": "replicated", "config": {{"x": {lists}}}}}')
        if levels <= MAX_NESTING:
            assert nesting(json.dumps(read_manifest(directory)["config"]["x"])) == levels - 2
        else:
            with pytest.raises(CheckpointUnreadable, match=rf"nested {levels} deep \(at most {MAX_NESTING}\)"):
                read_manifest(directory)


def test_a_deeply_nested_manifest_is_a_damaged_checkpoint_passed_over(tmp_path: Path) -> None:
    """100,000 nested lists in checkpoint.json (crafted, or garbage) are a damaged file like any
    other, refused before the JSON parser descends to the recursion limit (where a finalizer that
    ran printed a RecursionError of its own, now and then)."""
    config, out = write_tiny_gpt(
        tmp_path, train_iters=20, log_interval=5, eval_iters=0, extra="\n[checkpoint]\nsave_interval = 5\n"
    )
    assert run_here("run", str(config), "--set", "train.exit_interval=15", cwd=tmp_path).returncode == 0
    (step_dir(out, 15) / "checkpoint.json").write_text("[" * 100_000 + "]" * 100_000)
    result = run_here("run", str(config), cwd=tmp_path)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    warning = next(line for line in result.stderr.splitlines() if "falling back" in line)
    assert "checkpoint.json: cannot read the manifest: ValueError: arrays or objects nested 100000 deep" in warning
    assert "(step 10," in result.stderr


# --------------------------------------------------------------------------- 9. Ctrl-C from the first second


CUE_ARGPARSE = """
import importlib.util, pathlib, sys, sysconfig
pathlib.Path(__file__).with_name("loading").touch()  # the test's cue: coretrain's own code runs now
real = pathlib.Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
spec = importlib.util.spec_from_file_location("argparse", real)
module = importlib.util.module_from_spec(spec)
sys.modules["argparse"] = module
spec.loader.exec_module(module)
"""


def start_with_argparse(shim_source: str, config: Path, command: str) -> subprocess.Popen:
    """``coretrain run CONFIG`` (the console script pip made, or ``python -m coretrain``) with
    ``shim_source`` as the argparse the CLI imports; returned once the shim has run its cue."""
    shim = config.parent / "shim"
    shim.mkdir()
    (shim / "argparse.py").write_text(shim_source)
    script = (str(Path(sys.executable).parent / "coretrain"),)
    process = start_cli(
        "run",
        str(config),
        cwd=config.parent,
        env={"PYTHONPATH": str(shim)},
        **({"command": script} if command == "coretrain" else {}),
    )
    wait_for(lambda: (shim / "loading").exists(), process, timeout=60)
    return process


@pytest.mark.parametrize("delay", [0.0, 0.6, 1.5, 3.0])
@pytest.mark.parametrize("command", ["python -m coretrain", "coretrain"])
def test_ctrl_c_during_start_up_stops_the_run(tmp_path: Path, delay: float, command: str) -> None:
    """Ctrl-C at moments of start-up — loading the CLI, importing torch, building the run —
    counted from when coretrain's own code runs (the CLI importing argparse is the cue). A
    signal inside the interpreter's own start, before any of coretrain's code, is CPython's:
    it may print "Failed checking if argv[0] is an import path entry" and go on, as a 120 s
    hang of this test once showed when its first Ctrl-C was timed 50 ms after the launch."""
    config, _ = write_tiny_gpt(tmp_path, train_iters=100000, log_interval=50, eval_iters=0)
    process = start_with_argparse(CUE_ARGPARSE, config, command)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)  # ends: never trains 100000 steps
    assert f"coretrain{os.sep}" not in stderr, stderr  # no traceback through coretrain's code, ever
    assert process.returncode == 130, stderr
    assert "stopped by SIGINT during start-up" in stderr or "received SIGINT" in stderr, stderr


SLOW_ARGPARSE = """
import importlib.util, pathlib, sys, sysconfig, time
pathlib.Path(__file__).with_name("loading").touch()  # the test's cue: the CLI is being imported now
time.sleep(30)
"""


@pytest.mark.parametrize("command", ["python -m coretrain", "coretrain"])
def test_ctrl_c_while_the_cli_is_imported_is_quiet(tmp_path: Path, command: str) -> None:
    """A slow disk makes importing the CLI take long; argparse is made slow here, so the Ctrl-C lands
    exactly there, not by chance."""
    config, _ = write_tiny_gpt(tmp_path)
    process = start_with_argparse(SLOW_ARGPARSE, config, command)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "stopped by SIGINT during start-up" in stderr, stderr


# --------------------------------------------------------------------------- 10. every mistake: one line, exit 2


MISTAKES = {
    "seq_length = 0": ("--set", "data.options.seq_length=0", "data.options.seq_length: must be > 0, got 0"),
    "n_head = 0": ("--set", "model.options.n_head=0", "model.options.n_head: must be > 0, got 0"),
    "n_layer = -1": ("--set", "model.options.n_layer=-1", "model.options.n_layer: must be > 0, got -1"),
    "n_head does not divide": ("--set", "model.options.n_head=5", "model.options.n_head: must divide n_embd (32)"),
    "seed < 0": ("--set", "run.seed=-1", "run.seed: must be >= 0 and <= 4294967295, got -1"),
    "seed >= 2**32": ("--set", "run.seed=4294967296", "run.seed: must be >= 0"),
    "lr nan": ("--set", "optimizer.lr=nan", "optimizer.lr: expected a finite number, got nan"),
    "lr inf": ("--set", "optimizer.lr=inf", "optimizer.lr: expected a finite number, got inf"),
    "betas >= 1": ("--set", "optimizer.betas=[1.0, 0.9]", "optimizer.betas: must be >= 0 and < 1, got (1.0, 0.9)"),
    "valid_fraction > 1": (
        "--set",
        "data.options.valid_fraction=1.5",
        "data.options.valid_fraction: must be >= 0 and < 1",
    ),
    "micro batch too large": (
        "--set",
        "train.micro_batch_size=1000000000000",
        "the train split has 6249 sample(s), fewer than 1000000000000 (one global batch",
    ),
    "guards window 0": ("--set", "plugins.guards.window=0", "plugins.guards.window: must be > 0, got 0"),
    "gc interval < 0": ("--set", "plugins.gc.interval=-5", "plugins.gc.interval: must be >= 0, got -5"),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_a_config_mistake_is_one_error_line_with_exit_2(tmp_path: Path, name: str) -> None:
    flag, value, expected = MISTAKES[name]
    config, out = write_tiny_gpt(tmp_path, train_iters=5, eval_iters=0)
    result = run_here("run", str(config), flag, value, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert expected in one_error_line(result.stderr)
    assert not (out / "metrics.jsonl").exists() and not (out / "config.toml").exists()  # a rejected run records nothing


@pytest.mark.parametrize("name", ["n_head does not divide", "micro batch too large", "gc interval < 0"])
def test_config_validate_refuses_what_run_refuses(tmp_path: Path, name: str) -> None:
    flag, value, expected = MISTAKES[name]  # a structure check, a dataset check, a plugin check
    config, out = write_tiny_gpt(tmp_path, train_iters=5, eval_iters=0)
    validated = run_here("config", "validate", str(config), flag, value, cwd=tmp_path)
    assert validated.returncode == 2 and expected in one_error_line(validated.stderr)
    assert not out.exists()  # and writes nothing


def test_bad_files_and_providers_are_one_error_line_with_exit_2(tmp_path: Path) -> None:
    from coretrain_token_file import write_tokens

    config, out = write_tiny_gpt(tmp_path, train_iters=5, eval_iters=0)
    cases: list[tuple[tuple[str, ...], str]] = []
    (tmp_path / "afile").write_text("x")
    cases.append((("--set", f"run.output_dir={tmp_path / 'afile'}"), "exists and is not a directory"))
    latin = tmp_path / "latin.toml"
    latin.write_bytes(b'[run]\nname = "caf\xe9"\n')
    cases.append((("CONFIG", str(latin)), f"{latin}:2: not UTF-8 text (byte 0xe9)"))
    (tmp_path / "empty.bin").write_bytes(b"")
    (tmp_path / "adir.bin").mkdir()
    write_tokens(str(tmp_path / "wide.bin"), [i % 300 + 1 for i in range(20000)], "uint32")
    token_file = (
        config.read_text().replace('provider = "text-bytes"', 'provider = "token-file"').split("[data.options]")
    )
    for name, expected in [
        ("empty.bin", "the token file is empty"),
        ("adir.bin", "is a directory"),
        ("wide.bin", "every second uint16 is 0, as in a uint32 file"),
    ]:
        path = tmp_path / f"tokens-{name}.toml"
        path.write_text(
            token_file[0]
            + f'[data.options]\ntrain_path = "{tmp_path / name}"\nseq_length = 32\n'
            + "[train]"
            + token_file[1].split("[train]")[1]
        )
        cases.append((("CONFIG", str(path)), expected))
    (tmp_path / "providers.py").write_text(
        "import torch\n"
        "def not_a_model():\n    return 'a string'\ndef not_datasets(context):\n    return 42\n"
        "def frozen():\n    return torch.nn.Linear(2, 1).requires_grad_(False)\n"
    )
    cases.append(
        (
            ("--set", 'model.provider="providers:frozen"', "--set", "model.options={}"),
            "model.provider 'providers:frozen': the model has no trainable parameters (check its options)",
        )
    )
    cases.append(
        (
            ("--set", 'model.provider="providers:not_a_model"', "--set", "model.options={}"),
            "model.provider 'providers:not_a_model' returned a str, not a torch.nn.Module",
        )
    )
    cases.append(
        (
            ("--set", 'data.provider="providers:not_datasets"', "--set", "data.options={}"),
            "the train split is a int; a dataset is map-style (__len__ and __getitem__",
        )
    )
    for args, expected in cases:
        argv = [args[1]] if args[0] == "CONFIG" else [str(config), *args]
        result = run_here("run", *argv, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)})
        assert result.returncode == 2, (args, result.stderr)
        assert expected in one_error_line(result.stderr), (args, result.stderr)

    assert run_here("run", str(config), cwd=tmp_path).returncode == 0
    export = run_here(
        "checkpoint", "export", str(out), "--to", str(tmp_path / "missing" / "m.safetensors"), cwd=tmp_path
    )
    assert export.returncode == 2
    assert f"--to: directory '{tmp_path / 'missing'}' does not exist" in one_error_line(export.stderr)


def test_out_of_memory_in_a_step_is_one_line_with_the_sizes(tmp_path: Path) -> None:
    (tmp_path / "hungry.py").write_text(
        "import torch\n"
        "class Hungry(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.w = torch.nn.Linear(32, 1)\n"
        "    def forward(self, x, y):\n"
        "        torch.empty(10**14)  # activations that cannot fit\n"
        "        return self.w(x.float()).mean()\n"
        "def build():\n"
        "    return Hungry()\n"
    )
    config, out = write_tiny_gpt(tmp_path, train_iters=5, eval_iters=0)
    result = run_here(
        "run",
        str(config),
        "--set",
        'model.provider="hungry:build"',
        "--set",
        "model.options={}",
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 1
    assert one_error_line(result.stderr) == (
        "error: out of memory at step 1 on cpu (micro_batch_size 8 × seq_length 32, model 0.0M parameters): "
        "you tried to allocate 400000000000000 bytes; lower train.micro_batch_size (global_batch_size stays, "
        "through gradient accumulation) or the model size"
    )


def test_a_hung_plugin_in_a_single_process_run_is_named_and_the_run_ends(tmp_path: Path) -> None:
    hang = '\n[plugins.fault-injection]\naction = "hang"\nstep = 3\n\n[plugins.watchdog]\nstep_timeout_seconds = 2\n'
    config, out = write_tiny_gpt(tmp_path, train_iters=40, log_interval=1, eval_iters=0, extra=hang)
    # with no watchdog on one rank this hung until the test's own timeout
    result = run_cli("run", str(config), cwd=tmp_path, timeout=120)
    assert result.returncode == 124, result.stderr
    line = one_error_line(result.stderr)
    assert re.match(r"error: rank 0: no progress for \d+ s at step 3, last in pre_step", line), line
    assert "(plugin 'fault-injection', in its pre_step)" in line and "coretrain_fault_injection" in line, line
    assert (out / "hang.rank0.log").is_file()


def test_a_hung_single_process_ends_on_a_second_sigterm(tmp_path: Path) -> None:
    """A scheduler's grace period: SIGTERM, then SIGTERM again. The first waits for a step
    boundary the hung process never reaches; a second one seconds later ends it, by that signal."""
    from coretrain.signals import REPEAT_AFTER_SECONDS

    hang = '\n[plugins.fault-injection]\naction = "hang"\nstep = 3\n\n[plugins.watchdog]\nenabled = false\n'
    config, out = write_tiny_gpt(tmp_path, train_iters=40, log_interval=1, eval_iters=0, extra=hang)
    process = start_cli("run", str(config), cwd=tmp_path)
    run_log = out / "run.log"
    try:  # signalled once inside the hang: after step 2's metrics row it may still be at a step boundary
        wait_for(
            lambda: run_log.exists() and "fault-injection: hang on rank 0 at step 3" in run_log.read_text(), process
        )
        process.send_signal(signal.SIGTERM)
        time.sleep(REPEAT_AFTER_SECONDS + 0.5)
        assert process.poll() is None  # the first one waits for the step that never ends
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == -signal.SIGTERM
    finally:
        process.kill()
        process.communicate()
