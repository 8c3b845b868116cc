"""End to end: a GPT trains on real text and leaves its files behind. The run, checkpoint and
report commands go through the real CLI in a subprocess once each; the other cases run the same
commands in-process (``run_here``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import metrics_rows, run_cli, run_here, write_tiny_gpt

pytestmark = pytest.mark.slow  # the real CLI end to end: the full suite, not the fast tier


def test_gpt_on_stdlib_text_learns_and_leaves_config_metrics_and_checkpoints(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(tmp_path, train_iters=60, log_interval=10, eval_interval=30)
    result = run_cli("run", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr

    rows = metrics_rows(out)
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == [10, 20, 30, 40, 50, 60]
    assert train_rows[-1]["loss"] < 0.75 * train_rows[0]["loss"]  # learning, from ~5.5 (ln 256)
    assert [r["step"] for r in rows if "valid/loss" in r] == [30, 60]
    assert train_rows[0]["tokens_per_second"] > 0 and train_rows[0]["global_batch_size"] == 8
    assert (out / "config.toml").is_file()
    assert (out / "checkpoints" / "step_00000060" / "model.pt").is_file()
    # not a terminal: plain, one line per log interval
    progress = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(progress) == 6 and progress[-1].startswith("step 60/60 | loss ")
    # and in run.log, as Megatron's log has its training lines; the console shows them once
    logged = [
        line.split(": ", 1)[1] for line in (out / "run.log").read_text().splitlines() if "coretrain.progress" in line
    ]
    assert logged == progress and not any(line.startswith("step ") for line in result.stderr.splitlines())


def test_metrics_file_keeps_full_precision_floats(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(tmp_path, train_iters=5, log_interval=1, eval_iters=0)
    assert run_here("run", str(config), cwd=tmp_path).returncode == 0
    text = (out / "metrics.jsonl").read_text().splitlines()[0]
    loss = json.loads(text)["loss"]
    assert repr(loss) in text and len(repr(loss)) > 10  # not rounded for display


def test_exit_interval_then_rerun_resumes_and_each_step_is_logged_once(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(tmp_path, train_iters=20, log_interval=5, eval_iters=0)
    first = run_here("run", str(config), "--set", "train.exit_interval=10", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000010"]
    second = run_here("run", str(config), cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stderr and "(step 10, 80 samples consumed)" in second.stderr
    assert [r["step"] for r in metrics_rows(out)] == [5, 10, 15, 20]


def test_checkpoints_load_with_weights_only(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(tmp_path, train_iters=3, eval_iters=0)
    assert run_here("run", str(config), cwd=tmp_path).returncode == 0
    for name in ("model.pt", "optimizer.pt", "rank_00000.pt"):
        torch.load(out / "checkpoints" / "step_00000003" / name, weights_only=True)


def test_python_m_and_help_do_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys, contextlib, io\nimport coretrain\nassert 'torch' not in sys.modules\n"
        "from coretrain.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try: main(['--help'])\n    except SystemExit: pass\n"
        "assert 'torch' not in sys.modules, 'coretrain --help imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    listed = run_cli("--help", cwd=tmp_path)
    assert listed.returncode == 0 and "new-plugin" in listed.stdout


def test_progress_live_view_can_be_forced_and_shows_the_run(tmp_path: Path) -> None:
    config, _ = write_tiny_gpt(tmp_path, train_iters=10, log_interval=5, extra="\n[plugins.progress]\nplain = false\n")
    result = run_cli("run", str(config), cwd=tmp_path, env={"COLUMNS": "100"})
    assert result.returncode == 0, result.stderr
    assert "─ coretrain ─" in result.stdout and "10/10" in result.stdout
    assert "valid loss" in result.stdout and "completed at step 10" in result.stdout
    assert not any(line.startswith("step ") for line in result.stdout.splitlines())


def test_checkpoint_list_and_export(tmp_path: Path) -> None:
    """In this process (``run_here``): the commands' output is the point, not a process's start."""
    from safetensors.torch import load_file

    config, out = write_tiny_gpt(tmp_path, train_iters=6, eval_iters=0, extra="\n[checkpoint]\nsave_interval = 3\n")
    assert run_here("run", str(config), cwd=tmp_path).returncode == 0
    (out / "checkpoints" / "step_00000009.tmp").mkdir()
    listing = run_here("checkpoint", "list", str(out), cwd=tmp_path)
    assert listing.returncode == 0
    rows = [line.split() for line in listing.stdout.splitlines()[1:-1]]
    assert [(r[0], r[2]) for r in rows] == [("3", "complete"), ("6", "complete"), ("9", "incomplete")]
    assert listing.stdout.splitlines()[-1] == "3 checkpoint(s); 2 complete; latest: 6"

    exported = run_here(
        "checkpoint", "export", str(out), "--step", "3", "--to", str(tmp_path / "m.safetensors"), cwd=tmp_path
    )
    assert exported.returncode == 0, exported.stderr
    weights = load_file(str(tmp_path / "m.safetensors"))
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "m.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # readable as the user's files are
    saved = torch.load(out / "checkpoints" / "step_00000003" / "model.pt", weights_only=True)
    assert weights.keys() == saved.keys() and all(torch.equal(weights[k], saved[k]) for k in saved)
    missing = run_here("checkpoint", "export", str(out), "--step", "4", "--to", "x.safetensors", cwd=tmp_path)
    assert missing.returncode == 2 and "no complete checkpoint at that step; complete: [3, 6]" in missing.stderr


def test_logged_metrics_include_throughput_flops_mfu_time_and_memory(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(tmp_path, train_iters=20, log_interval=10, eval_iters=0)
    result = run_here("run", str(config), "--set", "plugins.timers.peak_tflops=0.5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    first, last = [r for r in metrics_rows(out) if "loss" in r]
    assert last["consumed_tokens"] == last["consumed_samples"] * 32 == 20 * 8 * 32
    assert last["tokens_per_second_per_device"] == last["tokens_per_second"]  # one rank
    assert last["tflops_per_device"] > 0 and last["mfu"] == last["tflops_per_device"] / 0.5
    assert first["remaining_seconds"] > 0 and last["remaining_seconds"] == 0
    assert last["elapsed_seconds"] > first["elapsed_seconds"] > 0
    assert 0 < last["memory/rss_gb"] <= last["memory/max_rss_gb"]


def test_progress_file_reports_nonzero_job_and_cumulative_throughput_across_jobs(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(tmp_path, train_iters=20, log_interval=10, eval_iters=0)
    assert run_here("run", str(config), "--set", "train.exit_interval=10", cwd=tmp_path).returncode == 0
    assert run_here("run", str(config), cwd=tmp_path).returncode == 0
    lines = [line.split("\t") for line in (out / "progress.txt").read_text().splitlines()]
    assert [(fields[3], fields[4]) for fields in lines] == [
        ("step 0", "job start"),
        ("step 10", "checkpoint"),
        ("step 10", "job start"),
        ("step 20", "checkpoint"),
    ]

    def figure(line: list[str], name: str) -> float:
        return float(next(field for field in line if field.startswith(name)).split()[len(name.split())])

    first, second = [fields for fields in lines if fields[4] == "checkpoint"]
    for line in (first, second):
        assert figure(line, "job throughput") > 0 and figure(line, "cumulative throughput") > 0
    assert figure(second, "tokens") == 2 * figure(first, "tokens") == 20 * 8 * 32
    assert figure(second, "FLOPs") == 2 * figure(first, "FLOPs")
    # cumulative = all FLOPs / all training time: between the two jobs' own rates
    rates = sorted([figure(first, "job throughput"), figure(second, "job throughput")])
    assert rates[0] <= figure(second, "cumulative throughput") <= rates[1]


def test_tensorboard_event_files_hold_what_metrics_jsonl_holds_even_after_sigterm(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, out = write_tiny_gpt(
        tmp_path,
        train_iters=20,
        log_interval=5,
        eval_interval=10,
        extra='\n[plugins.tensorboard]\n[plugins.fault-injection]\naction = "sigterm"\nstep = 16\n',
    )
    result = run_cli("run", str(config), cwd=tmp_path)
    assert result.returncode == 143, result.stderr  # closed on the signal path too
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    rows = metrics_rows(out)
    for name in ("loss", "lr", "grad_norm", "tokens_per_second", "valid/loss"):
        expected = [(r["step"], r[name]) for r in rows if name in r]
        stored = [(e.step, e.value) for e in events.Scalars(name)]
        assert [s for s, _ in stored] == [s for s, _ in expected] and expected
        assert all(v == pytest.approx(x, rel=1e-6) for (_, v), (_, x) in zip(stored, expected))  # float32 in TB


def test_report_plots_the_run_and_prints_its_summary(tmp_path: Path) -> None:
    import matplotlib.image

    config, out = write_tiny_gpt(
        tmp_path, train_iters=20, log_interval=5, eval_interval=10, extra="\n[plugins.model-stats]\n"
    )
    assert run_cli("run", str(config), "--set", "plugins.timers.peak_tflops=0.5", cwd=tmp_path).returncode == 0
    result = run_cli("report", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    rows = metrics_rows(out)
    last = [r for r in rows if "loss" in r][-1]
    assert f"→ {last['loss']:.4f}" in result.stdout and "best" in result.stdout and "MFU (median)" in result.stdout
    names = sorted(p.name for p in (out / "report").iterdir())
    assert names == [
        "grad_norm.png",
        "loss.png",
        "lr.png",
        "memory.png",
        "params_norm.png",
        "tflops.png",
        "throughput.png",
        "time.png",
    ]
    for name in names:
        height, width, _ = matplotlib.image.imread(out / "report" / name).shape
        assert (width, height) == (700, 400)
        assert f"wrote {out / 'report' / name}" in result.stdout


def test_report_skips_lines_that_are_not_metrics_and_names_the_first(tmp_path: Path) -> None:
    missing = run_here("report", str(tmp_path), cwd=tmp_path)
    assert missing.returncode == 2 and "metrics.jsonl: no such file; give the run's output dir" in missing.stderr
    deep = "[" * 100000 + "]" * 100000
    lines = [b'{"step": 5, "loss": 3.0}', b'{"step": 10, "loss": ', b"\x00\xff\xfe binary", deep.encode()]
    lines += [b'{"step": 15, "loss": "nan?"}', b'{"step": 20, "loss": 2.5}']
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    made = run_here("report", str(tmp_path), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    assert "metrics.jsonl: skipped 3 line(s) that are not metrics rows, first 2" in made.stderr
    assert "3.0000 → 2.5000" in made.stdout  # the string loss of step 15 is left out, not a crash
    assert "Traceback" not in made.stderr + missing.stderr


def test_random_offset_windows_train_and_resume_exactly(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(tmp_path, train_iters=20, log_interval=5, eval_iters=2)
    config.write_text(config.read_text().replace("max_bytes = 200000", 'max_bytes = 200000\nsampling = "random"'))
    whole = run_here("run", str(config), "--set", f"run.output_dir={tmp_path / 'whole'}", cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert run_here("run", str(config), "--set", "train.exit_interval=10", cwd=tmp_path).returncode == 0
    assert run_here("run", str(config), cwd=tmp_path).returncode == 0
    assert [(r["step"], r.get("loss")) for r in metrics_rows(out)] == [
        (r["step"], r.get("loss")) for r in metrics_rows(tmp_path / "whole")
    ]


def test_report_compares_runs_in_overlaid_plots_and_a_table_of_differences(tmp_path: Path) -> None:
    import matplotlib.image

    config, _ = write_tiny_gpt(tmp_path, train_iters=20, log_interval=5, eval_interval=10)
    for name, lr in (("base", "3e-3"), ("faster", "1e-2")):
        result = run_here(
            "run",
            str(config),
            "--set",
            f"run.output_dir={tmp_path / name}",
            "--set",
            f"optimizer.lr={lr}",
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr
    base, faster = (metrics_rows(tmp_path / n)[-1] for n in ("base", "faster"))
    with open(tmp_path / "faster" / "metrics.jsonl", "a") as f:
        f.write('{"step": 25, "loss": 1.')  # a run still writing its next line
    result = run_here("report", str(tmp_path / "base"), str(tmp_path / "faster"), cwd=tmp_path, env={"COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    out = tmp_path / "base" / "report" / "compare"
    names = sorted(p.name for p in out.iterdir())
    assert {"loss.png", "loss_vs_samples.png", "loss_vs_time.png", "throughput.png", "memory.png", "time.png"} <= set(
        names
    )
    assert matplotlib.image.imread(out / "loss.png").shape[:2] == (400, 700)
    row = next(line for line in result.stdout.splitlines() if "valid/loss (last)" in line)
    difference = faster["valid/loss"] - base["valid/loss"]
    assert f"{base['valid/loss']:.4f}" in row and f"{faster['valid/loss']:.4f}" in row and f"{difference:+.4g}" in row
    assert "faster − base" in result.stdout


def run_in_terminal(
    argv: list[str], cwd: Path, cols: int = 120, rows: int = 40, timeout: float = 300
) -> tuple[int, list[str]]:
    """Run a command in a real pseudo-terminal of cols × rows; the screen a person would see at the end."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    import pyte

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    env = {**os.environ, "COLUMNS": str(cols), "LINES": str(rows), "TERM": "xterm-256color"}
    process = subprocess.Popen(argv, cwd=cwd, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    screen = pyte.Screen(cols, rows)
    stream = pyte.ByteStream(screen)
    while True:
        ready, _, _ = select.select([master], [], [], 0.1)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not data:
                break
            stream.feed(data)
        elif process.poll() is not None:
            break
    os.close(master)
    return process.wait(timeout=timeout), [line.rstrip() for line in screen.display]


def test_the_live_view_leaves_exactly_one_panel_on_screen(tmp_path: Path) -> None:
    config, out = write_tiny_gpt(
        tmp_path, train_iters=300, log_interval=10, eval_interval=100, extra="\n[checkpoint]\nsave_interval = 100\n"
    )
    code, screen = run_in_terminal([sys.executable, "-m", "coretrain", "run", str(config)], tmp_path)
    assert code == 0, "\n".join(screen)
    text = "\n".join(screen)
    assert sum(line.startswith("╭") and "coretrain" in line for line in screen) == 1, text  # no stale copies
    assert sum(line.startswith("╰") for line in screen) == 1, text
    top = next(i for i, line in enumerate(screen) if line.startswith("╭"))
    above = "\n".join(screen[:top])
    for step in (100, 200, 300):  # log lines print above the panel, once each
        assert above.count(f"checkpoint step {step} saved") == 1, text
    assert "completed at step 300" in text and "300/300" in text and "steps/s   ETA 0:00:00" in text
    assert "step 100: valid loss" in text
