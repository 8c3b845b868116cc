"""Shared helpers: real CLI subprocesses, tiny configs, in-process runs with test plugins."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import tomli
from filelock import FileLock
from forked_ranks import run_ranks

from coretrain.cli import main
from coretrain.configload import deep_merge, toml_text
from coretrain.testing import write_config

REPO = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread per test process, as every run here asks (``run.threads = 1``): the
    tests that compute before any run would otherwise spin one intra-op thread per core in each
    xdist worker, and on a 2-core machine the workers then wait on each other's spinning. The
    processes the tests start inherit ``OMP_NUM_THREADS=1`` (torch's default for a config that
    sets no ``run.threads``). (Not in xdist's controller, which runs no test and need not load
    torch.)"""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if config.pluginmanager.hasplugin("dsession"):
        return
    import torch

    torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: one worker more than this process may use cores (PYTEST_XDIST_AUTO_NUM_WORKERS
    still decides where set). A worker spends much of a slow test waiting on what it started —
    ranks meeting, a launcher's restart, a heartbeat that must be missed — and with one worker
    per core the cores stood idle while both workers waited (README's pytest on 2 cores:
    21:43–28:09 with 2 workers, 17:56 with 3, 17:01 with 4; docs/benchmarks.md)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return cores + 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under xdist, each worker's first share of the tests opens with slow ones: xdist's
    work-stealing scheduler hands worker k the k-th contiguous block of the collection and an idle
    one steals from the end of another's. In file order one block held most of the torchrun and
    launcher tests and the suite's last minute ran one of them alone on an idle machine; dealt
    out in turn, the slow tests start together and the fast ones fill the end. Every worker
    collects, and orders, alike (xdist checks)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = [item for item in items if not item.get_closest_marker("slow")]
    ordered: list[pytest.Item] = []
    for worker in range(workers):
        size = (len(items) - len(ordered)) // (workers - worker)  # the block xdist sends this worker first
        share = slow[worker::workers]
        filled = max(size - len(share), 0)
        ordered += share + fast[:filled]
        del fast[:filled]
    items[:] = ordered + fast


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what the imports made (torch, transformers, the test modules) out of the collector's
    reach: a test's ``gc.collect()`` (the gc plugin's, a leak check's) then scans only what
    tests create, not a whole ML stack each time."""
    gc.freeze()


def load_script(path: Path) -> Any:
    """A script of the repository that is not a package (``benchmarks/``, ``docs/``) as a module,
    for a test that calls its parts as the script does."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_cli(
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: int = 300,
    command: tuple[str, ...] = (sys.executable, "-m", "coretrain"),
    inherit_env: bool = True,
    **popen: Any,
) -> subprocess.CompletedProcess:
    """``python -m coretrain ARGS`` (or ``command``, e.g. the console script, torchrun, pytest) as a
    user would run it, output captured (not a terminal); ``env`` adds to this process's
    environment, or replaces it with ``inherit_env=False``; ``popen``: more subprocess.run
    arguments (preexec_fn)."""
    with start_cli(
        *args, cwd=cwd, env=env, command=command, inherit_env=inherit_env, start_new_session=True, **popen
    ) as process:  # its own session: a timeout ends the ranks it started too, not only the launcher
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:  # each Python process prints its threads' stacks (faulthandler), then goes
            os.killpg(process.pid, signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.communicate(timeout=10)
            with contextlib.suppress(ProcessLookupError):  # (all gone already)
                os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            pytest.fail(f"`{' '.join(args)}` still running after {timeout} s; its stderr's end:\n{err[-12000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def run_train(
    *args: str, cwd: Path, env: Mapping[str, str] | None = None, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """``coretrain run ARGS``: through the CLI's launcher in subprocesses when ARGS ask for ranks
    (``--nproc-per-node N``), else in this process — the one-rank run a test compares ranks
    against, without paying another interpreter's torch import. Same result as :func:`run_cli`."""
    if "--nproc-per-node" in args:
        return run_cli("run", *args, cwd=cwd, env=dict(env or {}), timeout=timeout)
    return run_here("run", *args, cwd=cwd, env=env)


def run_here(*args: str, cwd: Path, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``coretrain ARGS`` through ``coretrain.cli.main`` in this process, output captured, and the
    working directory, environment, logging set-up and import path put back afterwards. An
    ``env`` PYTHONPATH is put on ``sys.path`` for the call; what was imported from it is dropped."""
    out, err = io.StringIO(), io.StringIO()
    root, saved_env, here, saved_path = logging.getLogger(), dict(os.environ), Path.cwd(), sys.path[:]
    handlers, level = root.handlers[:], root.level
    extra = [entry for entry in (env or {}).get("PYTHONPATH", "").split(os.pathsep) if entry]
    try:
        os.chdir(cwd)  # cli.main puts the current directory on sys.path, as `coretrain run` has it
        os.environ.update(env or {})
        sys.path[:0] = extra
        root.handlers[:] = []  # a fresh process's logging: pytest's capture handler would take the messages
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's usage errors
                code = exc.code if isinstance(exc.code, int) else 2
    finally:
        sys.path[:] = saved_path
        for name in [name for name, module in sys.modules.items() if _imported_from(module, [str(cwd), *extra])]:
            del sys.modules[name]
        os.chdir(here)
        os.environ.clear()
        os.environ.update(saved_env)
        root.handlers[:], root.level = handlers, level
        logging.captureWarnings(False)
    return subprocess.CompletedProcess(["coretrain", *args], code, out.getvalue(), err.getvalue())


def predict_texts(
    config: Path, texts: list[str], cwd: Path, *more: str
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """``coretrain predict CONFIG --data texts.jsonl`` in this process (:func:`run_here`), one
    ``prompt`` a text as a user writes them: the result and the records written (none when it failed)."""
    (cwd / "texts.jsonl").write_text("".join(json.dumps({"prompt": text}) + "\n" for text in texts))
    out = cwd / "answers.jsonl"
    done = run_here("predict", str(config), "--data", "texts.jsonl", "--out", str(out), *more, cwd=cwd)
    records = [json.loads(line) for line in out.read_text().splitlines()] if done.returncode == 0 else []
    return done, records


def _imported_from(module: object, directories: list[str]) -> bool:
    """Whether ``module`` came from one of a test's own directories (never the repository's code)."""
    path = str(getattr(module, "__file__", None) or "")
    if path.startswith(str(REPO) + os.sep):
        return False
    return any(path.startswith(directory + os.sep) for directory in directories)


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Poll ``condition`` until it holds; a test that waits on another process fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def free_port() -> int:
    """A port nothing listens on, for a rendezvous endpoint: below Linux's ephemeral range
    (32768-60999), from which the tests running beside this one take ports for their outgoing
    connections (gloo's, the stores') — one took a port picked there before the launcher bound it."""
    for port in random.SystemRandom().sample(range(20_000, 32_000), 100):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port between 20000 and 32000")


def start_cli(
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    command: tuple[str, ...] = (sys.executable, "-m", "coretrain"),
    inherit_env: bool = True,
    **popen: Any,
) -> subprocess.Popen:
    """``python -m coretrain ARGS`` (or ``command``) in the background (to signal, kill or race it);
    stdout and stderr piped. A fatal signal makes each Python process print its threads' stacks."""
    full_env = {
        **(os.environ if inherit_env else {}),
        "PYTHONUNBUFFERED": "1",
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }
    return subprocess.Popen(
        [*command, *args], cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen
    )


def torchrun(ranks: int) -> tuple[str, ...]:
    """``torchrun --standalone --nproc-per-node RANKS``, as a command prefix for :func:`run_cli`."""
    return (sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}")


def in_one_job(
    tmp_path: Path,
    ranks: int,
    commands: list[Any],
    name: str,
    env: dict[str, str] | None = None,
    agent: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``coretrain`` commands one after another, as that many jobs would run them: in this
    process for one rank, else all in one job of that many ranks forked from a warm process
    (``forked_ranks``: the imports paid once) running ``fixtures/commands_in_one_job.py`` —
    under torchrun's agent instead with ``agent``, for a test of what the agent provides. A
    command is an argument list, or ``{"args": [...], "expect": CODE}``; the job must give each
    its expected exit code (0 by default)."""
    if ranks == 1:
        for command in commands:
            args, expected = (command["args"], command["expect"]) if isinstance(command, dict) else (command, 0)
            done = run_here(*args, cwd=tmp_path, env=env)
            assert done.returncode == expected, (args, done.stderr)
        return done
    plan = tmp_path / f"{name}.json"
    plan.write_text(json.dumps(commands))
    if agent:
        script = str(REPO / "tests" / "fixtures" / "commands_in_one_job.py")
        job = run_cli(str(plan), cwd=tmp_path, env=env, command=(*torchrun(ranks), script))
    else:
        # a hang's guard, not a time limit: a long job on a busy machine (27 runs at 23 s each) needs more than 300 s
        job = run_ranks(plan, ranks, cwd=tmp_path, env=env, timeout=max(300, 40 * len(commands)))
    plan.with_name(f"{name}.stderr").write_text(job.stderr)  # the job's whole story, for a failure
    if job.returncode:
        pytest.fail(job_failure(job, commands, plan), pytrace=False)
    return job


def forked_steps(
    tmp_path: Path, ranks: int, steps: int, config: Mapping[str, Mapping[str, Any]]
) -> subprocess.CompletedProcess[str]:
    """``coretrain.testing.run_ranks``'s job — the tiny workload with ``config``'s tables on top,
    ``steps`` steps, gloo, its files in ``tmp_path / "out"`` — on ranks forked warm
    (:func:`in_one_job`), for a test of what the ranks compute rather than of torchrun."""
    from coretrain.testing import _write_steps_config  # run_ranks's own config writer

    distributed = {"backend": "gloo", **config.get("distributed", {})}
    path = _write_steps_config(tmp_path, steps, {}, {**config, "distributed": distributed})
    return in_one_job(tmp_path, ranks, [["run", str(path)]], "ranks")


def job_failure(job: subprocess.CompletedProcess[str], commands: list[Any], plan: Path) -> str:
    """What a failed ``in_one_job`` job says, whole (pytest truncates an assertion's message):
    the commands rank 0 finished with their codes, and the job's stderr from the start of the
    last of them — the failing rank may be one command behind rank 0 — with each rank's exit."""
    codes_file = plan.with_name(plan.name + ".codes")
    codes = json.loads(codes_file.read_text()) if codes_file.exists() else []
    args = [command["args"] if isinstance(command, dict) else command for command in commands]
    start = 0
    if codes:
        start = job.stderr.find("=== coretrain " + " ".join(args[len(codes) - 1]))
    said = job.stderr[max(start, 0) :].splitlines()
    exits = [line.strip() for line in said if line.strip().startswith(("rank ", "exitcode "))]
    each_rank = {
        path.name.rsplit(".", 1)[-1]: path.read_text() for path in sorted(plan.parent.glob(f"{plan.name}.codes.rank*"))
    }
    lines = [
        f"the job ended with {job.returncode}; rank 0 finished {len(codes)} of {len(commands)} commands: {codes}",
        f"each rank's codes: {each_rank}",
        f"last finished: {args[len(codes) - 1] if codes else None}",
        f"next: {args[len(codes)] if len(codes) < len(args) else None}",
        *exits,
        "--- stderr from the last finished command on (last 120 lines):",
        *said[-120:],
        *crashing_thread(job.stderr),
    ]
    return "\n".join(lines)


def crashing_thread(stderr: str) -> list[str]:
    """The C++ frames of the thread a fatal signal hit (c10 prints every thread's, the one that
    took the signal with ``fatalSignalHandler`` in them): for a crash in a thread Python does
    not know, where faulthandler names no current thread."""
    sections = re.split(r"\n(?=SIG[A-Z]+\(\d+\), PID: )", stderr)
    hit = [section for section in sections if "fatalSignalHandler(int" in section]
    return ["--- the crashing thread's C++ frames:", *hit[0].splitlines()[:40]] if hit else []


def per_command(stderr: str, configs: list[str]) -> dict[str, str]:
    """An ``in_one_job`` job's stderr cut at each command's first line (``=== coretrain run
    CONFIG``), by config: what one run of the job said."""
    starts = [stderr.index(f"=== coretrain run {path}") for path in configs]
    return {path: stderr[start:end] for path, start, end in zip(configs, starts, [*starts[1:], len(stderr)])}


def metrics_rows(out: Path) -> list[dict]:
    """What the metrics-file plugin wrote in a run's output dir, one dict per logged step."""
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def gpt_preset(output_dir: Path) -> dict[str, Any]:
    """A GPT run on a few standard-library files that takes seconds on CPU."""
    return {
        "run": {"name": "tiny", "output_dir": str(output_dir), "threads": 1},
        "model": {"provider": "gpt", "options": {"n_layer": 1, "n_head": 2, "n_embd": 32}},
        "data": {
            "provider": "text-bytes",
            "options": {"globs": [f"{STDLIB}/a*.py", f"{STDLIB}/b*.py"], "seq_length": 32, "max_bytes": 200000},
        },
        "optimizer": {"lr": 3e-3},
        "train": {"micro_batch_size": 8, "train_iters": 40, "log_interval": 5, "eval_iters": 2},
    }


HF_MOE = {
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4},
    "qwen2_moe": {"model_type": "qwen2_moe", "num_experts": 4, "shared_expert_intermediate_size": 32},
    "qwen3_moe": {"model_type": "qwen3_moe", "num_experts": 4, "head_dim": 16},
    "deepseek_v3": {
        **{"model_type": "deepseek_v3", "n_routed_experts": 4, "n_group": 2, "topk_group": 1, "n_shared_experts": 1},
        **{"first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8},
        **{"qk_nope_head_dim": 8, "v_head_dim": 16},
    },
}
"""Transformers' mixtures of experts, tiny (Mixtral-, Qwen2-MoE-, Qwen3-MoE- and DeepSeek-V3-shaped;
DeepSeek-V3's first layer dense, its routing by groups, its load balanced without an auxiliary loss)."""


def hf_moe_table(kind: str, layers: int) -> dict[str, Any]:
    """A tiny ``kind`` mixture of experts' config table (4 experts, top 2; with transformers'
    load-balancing loss where the architecture has one)."""
    table = {"hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": layers}
    table |= {"num_attention_heads": 2, "num_key_value_heads": 2, "num_experts_per_tok": 2, **HF_MOE[kind]}
    if kind != "deepseek_v3":
        table |= {"output_router_logits": True, "router_aux_loss_coef": 0.02}
    return table


def config_file(path: Path, preset: Mapping[str, Any], extra: str | Mapping[str, Any] = "", **train: Any) -> Path:
    """The tests' one config builder: ``preset`` (a complete config as a dict), ``train`` keys,
    then ``extra`` tables (TOML text or a dict) merged on top, written as TOML to ``path``."""
    data = deep_merge(dict(preset), {"train": train})
    if extra:
        data = deep_merge(data, tomli.loads(extra) if isinstance(extra, str) else extra)
    return write_config(path, data)


def tiny_gpt_config(output_dir: Path, **train: Any) -> str:
    """The GPT preset as TOML text (for tests that append tables to it)."""
    return toml_text(deep_merge(gpt_preset(output_dir), {"train": train}))


def write_tiny_gpt(directory: Path, extra: str = "", **train: Any) -> tuple[Path, Path]:
    """``directory/c.toml``: the tiny GPT run writing to ``directory/out``, then ``extra`` TOML; (config, out)."""
    out = directory / "out"
    return config_file(directory / "c.toml", gpt_preset(out), extra, **train), out


@pytest.fixture
def no_autoload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORETRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")


BROKEN_PLUGIN = {
    "pyproject.toml": """\
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "coretrain-broken"
        version = "0.1.0"
        [project.entry-points.coretrain]
        broken = "coretrain_broken:Broken"
        [tool.setuptools]
        packages = ["coretrain_broken"]
        """,
    "coretrain_broken/__init__.py": 'raise ImportError("needs libfoo, which is not installed")\n',
}


@pytest.fixture(scope="session")
def uninterrupted_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The losses of the fault tests' job without a fault (``test_inprocess_restart.config``, no
    plugin, 2 gloo ranks), run once per worker: the restarted jobs of five tests must equal it."""
    from test_inprocess_restart import config, losses

    root = tmp_path_factory.mktemp("uninterrupted")
    in_one_job(root, 2, [["run", config(root, "whole")]], "whole")
    return losses(root / "whole")


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """A target dir with real pip installs of third-party plugin packages, for PYTHONPATH.

    The example hooklog plugin, a plugin whose import fails, and the test-only
    kill-during-save plugin: found exactly as `pip install coretrain-foo` would make them.
    Built once per session (two builds and an install: 13 CPU-seconds), in the directory
    xdist's workers share, by the first worker that needs it; the tests only read it.
    """
    if worker_id == "master":  # no xdist: this session's own directory
        return install_site(tmp_path_factory.mktemp("thirdparty"))
    root = tmp_path_factory.getbasetemp().parent / "thirdparty"
    with FileLock(f"{root}.lock"):
        if not (root / "installed").exists():
            root.mkdir(exist_ok=True)
            install_site(root)
            (root / "installed").touch()
    return root / "site"


def install_site(root: Path) -> Path:
    """``site``'s packages pip-installed into ``root / "site"``, built from copies in ``root``."""
    broken = root / "broken-src"
    for name, text in BROKEN_PLUGIN.items():
        (broken / name).parent.mkdir(parents=True, exist_ok=True)
        (broken / name).write_text(textwrap.dedent(text))
    target = root / "site"
    # copies: setuptools builds in the source tree
    sources = [root / "hooklog-src", root / "faults-src"]
    for origin, copy in zip(
        [REPO / "examples" / "coretrain-hooklog", REPO / "tests" / "fixtures" / "coretrain-faults"], sources
    ):
        shutil.copytree(origin, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            *map(str, sources),
            str(broken),
        ],
        check=True,
    )
    return target


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast tier (``-m "not slow"``) runs in this process: a test that starts a subprocess
    (the CLI, torchrun, pip) is marked slow, or fails here saying so."""
    if request.node.get_closest_marker("slow") is not None:
        return
    original = subprocess.Popen.__init__

    def refuse(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        command = args if isinstance(args, str) else " ".join(str(a) for a in args)
        # library probes, not ours: ctypes.util's, and matplotlib's font cache built on first use
        if "ldconfig" in command or command.startswith(("uname", "/sbin/ldconfig", "fc-list")):
            original(self, args, *rest, **kwargs)
            return
        raise AssertionError(f"a fast-tier test started a process ({command[:120]}); mark it slow or run it in-process")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture
def cli() -> Any:
    """``coretrain ARGS`` in this process, output captured (:func:`run_here`): what the fast tier
    uses instead of a subprocess. Same call and result as :func:`run_cli`."""
    return run_here


CORPUS = [f"def function_{i}(x):\n    return x * {i} + {i % 7}" for i in range(400)]
PROSE = [f"The quick brown fox {i} jumps over the lazy dog number {i * 3}." for i in range(400)]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer trained here, saved as a user's downloaded tokenizer is."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(
        CORPUS + PROSE, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    )
    import transformers

    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    directory = tmp_path_factory.mktemp("tok") / "tokenizer"
    fast.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def padding_tokenizer_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test tokenizer with a pad token, as a decoder's tokenizer is given one (its EOS)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.pad_token = tok.eos_token
    directory = tmp_path_factory.mktemp("tok") / "padding"
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def text_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:

    root = tmp_path_factory.mktemp("text")
    (root / "code.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(CORPUS)))
    (root / "prose.txt").write_text("\n".join(PROSE) + "\n")
    import datasets

    datasets.Dataset.from_dict({"body": PROSE}).to_parquet(str(root / "prose.parquet"))
    return {"code": root / "code.jsonl", "prose": root / "prose.txt", "parquet": root / "prose.parquet"}


def train_llama(
    tmp_path: Path, layouts: Mapping[str, Mapping[str, Any]], train: Mapping[str, Any], **config: Any
) -> None:
    """A tiny Llama (the hf provider, built from its config: 4 query heads on 2 key/value heads,
    ``config`` on top) trained on the GPT preset's data in each layout, by name: ``{}`` on one
    rank, any other ``[distributed]`` table on as many ranks as its sizes multiply to (2 at
    least), its ``plugins`` key the ``[plugins]`` tables; output in ``tmp_path / name``. The
    layouts of one number of ranks run in one job (one rank: in this process)."""
    llama = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    llama |= {"num_attention_heads": 4, "num_key_value_heads": 2, **config}
    by_ranks: dict[int, list[Any]] = {}
    for name, distributed in layouts.items():
        preset = gpt_preset(tmp_path / name)
        preset["model"] = {"provider": "hf", "options": {"config": llama}}
        sections = {"distributed": {key: value for key, value in distributed.items() if key != "plugins"}}
        sections |= {"plugins": distributed["plugins"]} if "plugins" in distributed else {}
        path = config_file(tmp_path / f"{name}.toml", preset, sections, **train)
        ranks = (
            max(2, math.prod(size for key, size in distributed.items() if key.endswith("_size"))) if distributed else 1
        )
        by_ranks.setdefault(ranks, []).append(["run", str(path)])
    for ranks, commands in by_ranks.items():  # one job per number of ranks, as that many jobs would run them
        in_one_job(tmp_path, ranks, commands, f"llama-{ranks}", env={"OMP_NUM_THREADS": "1"})


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The test-only plugins of ``tests/fixtures/coretrain-faults`` as a module, for in-process
    runs (the ``site`` fixture pip-installs the same package for subprocesses)."""
    monkeypatch.syspath_prepend(str(REPO / "tests" / "fixtures" / "coretrain-faults"))
    import coretrain_faults

    return coretrain_faults
