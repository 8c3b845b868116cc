"""The release: both distributions build as wheels, install into a fresh environment with torch
and nothing of this checkout, and train from a config in a directory of the user's."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from conftest import REPO


def build_wheels(into: Path, work: Path) -> list[str]:
    """``pip wheel`` of both distributions, from copies of what they package (setuptools builds in
    the source tree), with this environment's setuptools; the wheels' names."""
    core = work / "coretrain"
    core.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, core / name)
    ignore = shutil.ignore_patterns("build", "*.egg-info", "__pycache__")
    shutil.copytree(REPO / "coretrain", core / "coretrain", ignore=ignore)
    shutil.copytree(REPO / "plugins", work / "coretrain-plugins", ignore=ignore)
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(into)]
    subprocess.run([*command, str(core), str(work / "coretrain-plugins")], check=True, timeout=600)
    return sorted(path.name for path in into.glob("*.whl"))


@pytest.mark.slow  # a fresh venv: torch (from pip's cache, not byte-compiled) and the two wheels' dependencies
def test_the_two_wheels_install_without_the_trackers_and_train_outside_the_checkout(tmp_path: Path) -> None:
    wheels, work = tmp_path / "wheels", tmp_path / "work"
    wheels.mkdir()
    work.mkdir()
    built = build_wheels(wheels, work)
    assert built == ["coretrain-1.0.0-py3-none-any.whl", "coretrain_plugins-1.0.0-py3-none-any.whl"], built
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    pip = [sys.executable, "-m", "pip", "--python", str(python)]  # this pip, installing into the venv
    torch_pin = f"torch=={torch.__version__.split('+')[0]}"  # the build this suite runs on (pip's cache has it)
    # (--no-compile: byte-compiling the 5,000 modules of torch and its dependencies was 18 of the
    # install's 29 CPU-seconds)
    install = [*pip, "install", "--quiet", "--no-compile", torch_pin, *map(str, wheels.glob("*.whl"))]
    subprocess.run(install, check=True, timeout=1200)
    # no tracker SDK, no Hugging Face library came with them: those are extras
    missing = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.util as u; print([m for m in ('wandb', 'comet_ml', 'mlflow', "
            "'tensorboard', 'transformers', 'torchao') if u.find_spec(m)])",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert missing.stdout.strip() == "[]", missing.stdout
    users = tmp_path / "users-project"  # nothing of the checkout on the path: the installed wheels alone
    users.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    (users / "c.toml").write_text(
        '[run]\noutput_dir = "out"\nthreads = 1\n[model]\nprovider = "gpt"\n'
        "[model.options]\nn_layer = 1\nn_head = 2\nn_embd = 32\n"
        f'[data]\nprovider = "text-bytes"\n[data.options]\nglobs = ["{stdlib}/a*.py"]\nseq_length = 32\n'
        "max_bytes = 100000\n[train]\nmicro_batch_size = 8\ntrain_iters = 6\nlog_interval = 3\neval_iters = 1\n"
    )
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"OMP_NUM_THREADS": "1", "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}"}
    job = subprocess.run(
        [str(venv / "bin" / "coretrain"), "run", "c.toml"],
        cwd=users,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert job.returncode == 0, job.stderr[-3000:]
    rows = [json.loads(line) for line in (users / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "loss" in row] == [3, 6]
    version = subprocess.run([str(venv / "bin" / "coretrain"), "--version"], capture_output=True, text=True, env=env)
    assert version.stdout.strip() == "coretrain 1.0.0"
    # the core alone (coretrain-plugins removed) still imports, has its one command (run) and says what is missing
    subprocess.run([*pip, "uninstall", "--quiet", "-y", "coretrain-plugins"], check=True)
    listing = subprocess.run([str(venv / "bin" / "coretrain"), "plugins"], capture_output=True, text=True, env=env)
    assert listing.returncode == 2 and re.search(
        r"invalid choice: 'plugins' \(choose from '?run'?\)", listing.stderr
    ), listing.stdout + listing.stderr
    assert "Traceback" not in listing.stderr and len(listing.stderr.splitlines()) == 1
    peers = [str(venv / "bin" / "coretrain"), "run", "c.toml", "--set", "train.max_steps=5"]  # the wheel's data file
    named = subprocess.run(peers, cwd=users, env=env, capture_output=True, text=True)
    assert named.returncode == 2 and "train.max_steps: unknown key (here it is train.train_iters)" in named.stderr, (
        named.stderr
    )
    alone = subprocess.run(
        [str(venv / "bin" / "coretrain"), "run", "c.toml"], cwd=users, env=env, capture_output=True, text=True
    )
    assert alone.returncode == 2 and "Traceback" not in alone.stderr, alone.stderr
    assert "model.provider: no plugin named 'gpt' is installed; installed: none (install one" in alone.stderr, (
        alone.stderr
    )
