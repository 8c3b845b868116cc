"""``coretrain run --nnodes``: several "machines" on this one, each its own launcher process."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, metrics_rows, run_cli, wait_for, write_tiny_gpt


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (the ranks a launcher started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def job_starts(out: Path) -> list[int]:
    """The world size of every job start progress.txt recorded."""
    path = out / "progress.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [int(line.split("\tworld ")[1].split("\t")[0]) for line in lines if line.endswith("job start")]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a launcher's death reaches its ranks on Linux")
def test_an_elastic_job_takes_a_machine_that_joins_and_goes_on_without_one_whose_launcher_was_killed(
    tmp_path: Path,
) -> None:
    """Machine A starts alone (--nnodes 1:2); machine B joins: the ranks stop with a checkpoint
    and resume on 2. Then B's launcher is SIGKILLed alone: its rank stops with it (checkpoint),
    A restarts its rank, resumes on 1 and finishes. No environment variable is set."""
    # 0.2 s steps: B's launcher, started under load at step 10, must join before A's job ends (22 s)
    slow_steps = '[plugins.fault-injection]\naction = "sleep"\nstep = 1\nevery_step = true\nsleep_seconds = 0.2\n'
    config, out = write_tiny_gpt(
        tmp_path, slow_steps + "[checkpoint]\nsave_interval = 5\n", micro_batch_size=4, global_batch_size=8
    )
    config.write_text(config.read_text().replace("train_iters = 40", "train_iters = 120"))
    port = free_port()
    launch = ("--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", "last_call_timeout=1")
    command = [sys.executable, "-m", "coretrain", "run", str(config), *launch, "--max-restarts", "2"]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env["OMP_NUM_THREADS"] = "1"

    def machine(name: str) -> subprocess.Popen[bytes]:
        with open(tmp_path / f"{name}.log", "wb") as log:
            return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)

    a = machine("a")
    b = None
    try:
        wait_for(lambda: job_starts(out) == [1] and (out / "checkpoints" / "step_00000010").is_dir(), "A training")
        b = machine("b")
        wait_for(lambda: job_starts(out) == [1, 2], "the job to grow to 2 ranks")
        wait_for(lambda: bool(children(b.pid)), "B's rank")
        rank_of_b = children(b.pid)[0]
        step_before_kill = metrics_rows(out)[-1]["step"]
        b.send_signal(signal.SIGKILL)  # the launcher alone; its rank is not signalled by anyone else
        wait_for(lambda: not Path(f"/proc/{rank_of_b}").exists(), "B's rank to stop with its launcher", 60)
        assert a.wait(timeout=240) == 0, (tmp_path / "a.log").read_text()[-3000:]
    finally:
        for launcher in (a, b):
            if launcher is not None and launcher.poll() is None:
                launcher.kill()
    log = (tmp_path / "a.log").read_text()
    assert job_starts(out) == [1, 2, 1]
    assert log.count("received SIGTERM") == 2  # both changes stopped the ranks with a checkpoint
    assert log.count("resumed at step") == 2
    rows = [row for row in metrics_rows(out) if "loss" in row]
    assert rows[-1]["step"] == 120
    assert [row["step"] for row in rows] == sorted({row["step"] for row in rows})  # each step logged once
    assert step_before_kill < 120


@pytest.mark.slow
def test_ranks_that_cannot_be_restarted_meet_at_the_store_the_launcher_holds(tmp_path: Path) -> None:
    """On one machine without --max-restarts the ranks meet at the launcher's own store, bound for
    the whole job (torchrun's default): a store of rank 0's would listen on a port the launcher
    found free and let go, and a connection of another job on the machine took it first
    (EADDRINUSE, seen with tests side by side). Ranks the launcher may restart keep their own
    (restarted gloo groups reached the dead attempt's ports through the shared one)."""
    config, _ = write_tiny_gpt(tmp_path, train_iters=1)
    said = tmp_path / "ranks.txt"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(
        "import os\n"
        "if 'LOCAL_RANK' in os.environ:\n"
        f"    with open({str(said)!r}, 'a') as said:\n"
        "        said.write(os.environ['TORCHELASTIC_USE_AGENT_STORE'] + '\\n')\n"
    )
    env = {"PYTHONPATH": str(tmp_path / "site"), "OMP_NUM_THREADS": "1"}
    for restarts, agents_store in (("0", "True"), ("1", "False")):
        said.write_text("")
        job = run_cli("run", str(config), "--nproc-per-node", "2", "--max-restarts", restarts, cwd=tmp_path, env=env)
        assert job.returncode == 0, job.stderr[-3000:]
        assert said.read_text().split() == [agents_store, agents_store], restarts


def test_a_rendezvous_port_held_by_another_program_is_one_error_also_on_one_machine(tmp_path: Path, cli: Any) -> None:
    """A program that listens and never answers, and one that holds the port without listening:
    torchrun waited its whole join timeout without a word. --rdzv-endpoint with one machine
    is used (its ranks meet there), so it is checked too."""
    config, _ = write_tiny_gpt(tmp_path)
    config.write_text(config.read_text() + "\n[plugins.inprocess-restart]\n")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))  # bound, not listening
    try:
        for sock, message in (
            (
                silent,
                "another program listens there and does not answer as a rendezvous store (none within 2 s); "
                "choose a free port",
            ),
            (holder, "the port is held by another program; choose a free port"),
        ):
            endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
            flags = ("--nproc-per-node", "1", "--rdzv-endpoint", endpoint, "--rdzv-conf", "read_timeout=2")
            own = ("--nnodes", "1:2", "--replace-failed-ranks")  # coretrain's launcher across machines
            for launch in (flags, (*flags, *own)):
                result = cli("run", str(config), *launch, cwd=tmp_path)
                assert result.returncode == 2 and result.stderr == f"error: --rdzv-endpoint {endpoint}: {message}\n"
    finally:
        silent.close()
        holder.close()
    from coretrain_launch import torchrun_arguments

    args = argparse.Namespace(
        nnodes=None,
        nproc_per_node=2,
        rdzv_endpoint="127.0.0.1:29400",
        rdzv_id="x",
        rdzv_conf=None,
        node_rank=None,
        max_restarts=0,
        config="c.toml",
        overrides=[],
    )
    assert torchrun_arguments(args)[:6] == [
        "--nnodes",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "127.0.0.1:29400",
    ]


def test_a_store_that_leaves_as_this_machine_comes_is_not_called_another_program() -> None:
    """The job at the endpoint ends between the launcher's two looks at it (a connection, then a
    store's request): the port is free now, not held by a silent program — no error, the
    launcher goes on (seen in CI: a machine that came as a job ended was told to choose a free
    port)."""
    from coretrain_launch.endpoint import check_endpoint

    port = free_port()
    leaving = socket.socket()
    leaving.bind(("127.0.0.1", port))
    leaving.listen(1)

    def leave() -> None:
        connection, _ = leaving.accept()  # the first look: someone listens
        connection.close()
        leaving.close()  # then the job ends

    thread = threading.Thread(target=leave)
    thread.start()
    try:
        check_endpoint(f"127.0.0.1:{port}", "read_timeout=2")
    finally:
        thread.join(timeout=30)
        leaving.close()


def test_a_config_mistake_is_said_once_before_any_rank_starts(tmp_path: Path, cli: Any) -> None:
    config, _ = write_tiny_gpt(tmp_path, "[train]\ntrain_iter = 3\n")
    result = cli("run", str(config), "--nproc-per-node", "2", cwd=tmp_path)
    assert (
        result.returncode == 2
        and result.stderr.count("error:") == 1
        and "train.train_iter: unknown key" in result.stderr
    )


def test_launch_flags_that_cannot_work_are_one_error(tmp_path: Path, cli: Any) -> None:
    config, _ = write_tiny_gpt(tmp_path)
    cases = {
        ("--nnodes", "2"): "error: --nnodes 2: the machines need a meeting point; add --rdzv-endpoint HOST:PORT",
        ("--nnodes", "3:2"): "error: --nnodes 3:2: expected a number of machines N or MIN:MAX (e.g. 2 or 1:4)",
        ("--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"): "error: --node-rank 2: expected 0..1",
        ("--nnodes", "1:2", "--node-rank", "0", "--rdzv-endpoint", "h:1"): "numbers machines as they join",
    }
    for flags, message in cases.items():
        result = cli("run", str(config), *flags, cwd=tmp_path)
        assert result.returncode == 2 and message in result.stderr, (flags, result.stderr)
        assert "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a launcher's death reaches its ranks on Linux")
def test_when_the_rendezvous_host_leaves_the_other_machine_stops_with_one_line(tmp_path: Path) -> None:
    """Machines A (hosting the rendezvous) and B train together; A's launcher is SIGKILLed. B's
    ranks stop with a checkpoint, and B says so in one line: no C++ stack, no 'failed' for an
    agreed stop."""
    slow_steps = '[plugins.fault-injection]\naction = "sleep"\nstep = 1\nevery_step = true\nsleep_seconds = 0.05\n'
    config, out = write_tiny_gpt(
        tmp_path, slow_steps + "[checkpoint]\nsave_interval = 50\n", micro_batch_size=4, global_batch_size=8
    )
    config.write_text(config.read_text().replace("train_iters = 40", "train_iters = 100000"))
    launch = ("--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-conf", "last_call_timeout=1")
    command = [sys.executable, "-m", "coretrain", "run", str(config), *launch]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = {name: tmp_path / f"{name}.log" for name in "ab"}
    machines: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name in "ab":
            with open(logs[name], "wb") as log:
                machines[name] = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
            wait_for(lambda: job_starts(out)[-1:] == [len(machines)], f"{len(machines)} rank(s) training")
        wait_for(lambda: len(metrics_rows(out)) >= 3, "steps on 2 ranks")
        step_at_kill = metrics_rows(out)[-1]["step"]
        machines["a"].send_signal(signal.SIGKILL)  # the host of the rendezvous, gone without a word
        code = machines["b"].wait(timeout=120)
    finally:
        for launcher in machines.values():
            if launcher.poll() is None:
                launcher.kill()
    log = logs["b"].read_text()
    assert "frame #" not in log and "Traceback" not in log, log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    stopped = "stopped on SIGTERM after saving a checkpoint (exit 143)" in log
    assert (code == 143 and stopped and not errors) or (
        code == 1 and len(errors) == 1 and errors[0].startswith("error: lost the rendezvous at 127.0.0.1:")
    ), log[-3000:]
    saved = sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_????????"))
    assert saved and saved[-1] >= step_at_kill  # the ranks checkpointed where they stopped


def rank_pid(launcher: int, rank: int) -> int:
    """The process of ``rank`` among a launcher's children (from its environment)."""
    for pid in children(launcher):
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environment:
            return pid
    raise AssertionError(f"no rank {rank} under {launcher}")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, SIGSTOP")
@pytest.mark.parametrize("frozen", [1, 0])
def test_a_frozen_rank_is_named_by_the_others_and_in_the_jobs_last_line(tmp_path: Path, frozen: int) -> None:
    """A rank stopped with SIGSTOP runs no thread, so it cannot name itself: the other rank,
    waiting for it, reads the heartbeats in the rendezvous store (rank 0 holds that store under
    coretrain's launcher: its silence names it) and ends the job; the launcher's last line
    names the frozen rank, not the one that reported it."""
    timeouts = "[distributed]\ninit_timeout_seconds = 300\n[plugins.watchdog]\nstep_timeout_seconds = 6\n"
    config, out = write_tiny_gpt(tmp_path, timeouts, train_iters=100000, log_interval=10, eval_iters=0)
    errors = tmp_path / "stderr.log"
    with open(errors, "w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "coretrain", "run", str(config), "--nproc-per-node", "2"],
            cwd=tmp_path,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
    try:
        wait_for(lambda: len(metrics_rows(out)) >= 2 if (out / "metrics.jsonl").exists() else False, "training")
        stopped = rank_pid(launcher.pid, frozen)
        os.kill(stopped, signal.SIGSTOP)
        wait_for(lambda: "is not responding" in errors.read_text(), "the other rank's verdict", 120)
        os.kill(stopped, signal.SIGKILL)  # else the launcher waits 30 s for it to take its SIGTERM
        code = launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    lines = [line for line in errors.read_text().splitlines() if line.startswith("error:")]
    assert code == 124 and lines, errors.read_text()[-3000:]
    reporter = 1 - frozen
    assert lines[-1].startswith(f"error: rank {frozen} ") and "is not responding" in lines[-1], lines
    assert f"rank {reporter} waited" in lines[-1]


def test_the_jobs_last_line_names_the_rank_a_signal_killed_not_the_lowest_that_lost_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """torchrun finds failures in one look at the ranks, so they share that second as their
    timestamp, and torch names the first found: rank 0, ended (exit 1) because rank 1 was
    SIGKILLed and vanished from its collective. A rank the launcher itself SIGTERMed once the
    job had failed is never the culprit."""
    from coretrain_launch import child_failed
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    def failed(*codes: tuple[int, int], first_seconds_earlier: int = 0) -> int:
        failures = {r: ProcessFailure(r, 100 + r, code, str(tmp_path / f"none{r}.json")) for r, code in codes}
        for failure in failures.values():
            failure.timestamp = 1_700_000_000
        failures[codes[0][0]].timestamp -= first_seconds_earlier
        return child_failed(ChildFailedError("coretrain", failures))

    assert failed((0, 1), (1, -9)) == 137
    assert capsys.readouterr().err.strip() == "error: rank 1 failed with exit code -9"
    assert failed((0, 1), (1, -9), first_seconds_earlier=1) == 1  # rank 0 failed a look earlier
    assert capsys.readouterr().err.strip() == "error: rank 0 failed with exit code 1"
    assert failed((1, 1), (0, -15)) == 1  # rank 0 was ended by the launcher after rank 1 failed
    assert capsys.readouterr().err.strip() == "error: rank 1 failed with exit code 1"


STORE_LOST = """
import datetime, os, subprocess, sys, time
if sys.argv[1] == "launcher":
    from coretrain_launch import quiet_torch_logging_here

    quiet_torch_logging_here()
import torch.distributed as dist

port = int(sys.argv[2])
host = f"import torch.distributed as d, datetime, time; s = d.TCPStore('127.0.0.1', {port}, 2, True); time.sleep(60)"
server = subprocess.Popen([sys.executable, "-c", host])
client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
server.kill()
server.wait()
try:
    client.get("never-set")
except dist.DistError:
    print("lost the store; TORCH_CPP_LOG_LEVEL =", os.environ.get("TORCH_CPP_LOG_LEVEL"))
"""


@pytest.mark.slow  # subprocesses: a TCPStore host that dies
def test_the_launchers_own_torch_cpp_warnings_are_off_and_its_ranks_keep_the_users_setting(tmp_path: Path) -> None:
    """A store client whose host died prints a C++ warning with its stack ("frame #0: ...") as
    torch loads it; coretrain's launcher turns torch's C++ logging off for itself before torch
    loads (it once did so after, to no effect, and a machine leaving buried the launcher's one
    line in a stack), and gives the variable back for the ranks it starts."""
    script = tmp_path / "store_lost.py"
    script.write_text(STORE_LOST)
    env = {key: value for key, value in os.environ.items() if key != "TORCH_CPP_LOG_LEVEL"}
    plain, launcher = (
        subprocess.run([sys.executable, str(script), role, str(free_port())], capture_output=True, text=True, env=env)
        for role in ("plain", "launcher")
    )
    assert "lost the store; TORCH_CPP_LOG_LEVEL = None" in plain.stdout, plain.stderr[-2000:]
    assert "frame #" in plain.stderr  # what torch prints when it is not told otherwise
    assert "lost the store; TORCH_CPP_LOG_LEVEL = None" in launcher.stdout, launcher.stderr[-2000:]
    assert "frame #" not in launcher.stderr
