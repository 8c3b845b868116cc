"""Plugins are found through entry points only, imported lazily, configured strictly.

Third-party packages are real: built and pip-installed into a target directory that the
runs see through PYTHONPATH, exactly as `pip install coretrain-foo` would make them visible.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli, run_here, write_tiny_gpt

from coretrain import hookimpl
from coretrain.configload import load_config
from coretrain.errors import UserError
from coretrain.pluginmanager import Plugins, discover, enabled_tables

pytestmark = pytest.mark.slow  # pip installs of plugin packages: the full suite, not the fast tier


def test_third_party_plugin_is_found_enabled_from_toml_and_called_in_a_real_run(site: Path, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(site)}
    listing = run_cli("plugins", cwd=tmp_path, env=env)
    assert listing.returncode == 0
    assert "hooklog  coretrain-hooklog 0.1.0" in listing.stdout
    assert "hooks: on_checkpoint, on_eval, on_log, on_resume, on_train_end, on_train_start, post_step" in listing.stdout

    config, out = write_tiny_gpt(
        tmp_path, train_iters=10, exit_interval=6, eval_interval=5, extra='\n[plugins.hooklog]\npath = "calls.jsonl"\n'
    )
    first = run_here("run", str(config), cwd=tmp_path, env=env)  # the listing above ran as a new process
    assert first.returncode == 0, first.stderr
    second = run_here("run", str(config), cwd=tmp_path, env=env)
    assert second.returncode == 0, second.stderr
    calls = [json.loads(line) for line in (out / "calls.jsonl").read_text().splitlines()]
    assert [(c["hook"], c["step"]) for c in calls] == [
        ("on_train_start", 0),
        ("on_log", 5),
        ("on_eval", 5),
        ("on_checkpoint", 6),
        ("on_train_end", 6),
        ("on_resume", 6),
        ("on_train_start", 6),
        ("on_log", 10),
        ("on_eval", 10),
        ("on_checkpoint", 10),
        ("on_train_end", 10),
    ]
    assert calls[5]["steps_seen"] == 6 and calls[-1]["steps_seen"] == 10  # its state survived the restart
    assert calls[4]["outcome"] == "exit_interval" and calls[-1]["outcome"] == "completed"

    # the package's command, found through the coretrain.commands entry points as the core's are
    assert "hooklog  coretrain-hooklog 0.1.0  coretrain_hooklog:add" in listing.stdout
    counted = run_cli("hooklog", str(out), "--path", "calls.jsonl", cwd=tmp_path, env=env)
    assert counted.returncode == 0, counted.stderr
    assert "on_log: 2\non_resume: 1\non_train_end: 2\non_train_start: 2" in counted.stdout
    missing = run_cli("hooklog", str(tmp_path), cwd=tmp_path, env=env)
    assert missing.returncode == 2 and missing.stderr.startswith("error: ") and "Traceback" not in missing.stderr


def test_a_broken_command_package_is_skipped_with_one_line_and_the_others_work(tmp_path: Path) -> None:
    source = tmp_path / "src"
    (source / "coretrain_badcmd").mkdir(parents=True)
    (source / "coretrain_badcmd" / "__init__.py").write_text('raise ImportError("needs libbar")\n')
    (source / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "coretrain-badcmd"\nversion = "0.1.0"\n'
        '[project.entry-points."coretrain.commands"]\nbadcmd = "coretrain_badcmd:add"\n'
        '[tool.setuptools]\npackages = ["coretrain_badcmd"]\n'
    )
    target = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target"]
    subprocess.run([*pip, str(target), str(source)], check=True)
    result = run_cli("config", "show", "--help", cwd=tmp_path, env={"PYTHONPATH": str(target)})
    assert result.returncode == 0, result.stderr
    assert result.stderr == "coretrain: command 'badcmd' from coretrain-badcmd is skipped: needs libbar\n"


def test_a_broken_plugin_is_named_with_its_distribution_and_cause_and_stops_the_run(site: Path, tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(site)}
    config, _ = write_tiny_gpt(tmp_path, train_iters=2, extra="\n[plugins.broken]\n")
    result = run_cli("run", str(config), cwd=tmp_path, env=env)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        "error: plugin 'broken' (from coretrain-broken 0.1.0) failed to import coretrain_broken:Broken: "
        "ImportError: needs libfoo, which is not installed"
    ) in result.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists()  # stopped before training
    listing = run_cli("plugins", cwd=tmp_path, env=env)
    assert listing.returncode == 0 and "broken  coretrain-broken 0.1.0  broken: " in listing.stdout


def test_a_broken_plugin_that_is_not_enabled_is_never_imported(site: Path, tmp_path: Path) -> None:
    config, _ = write_tiny_gpt(tmp_path, train_iters=2, eval_iters=0)
    result = run_cli("run", str(config), cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr


def test_discovery_reads_metadata_without_importing_plugins() -> None:
    code = (
        "import sys; from coretrain.pluginmanager import discover; found = discover(); "
        "assert {'gpt', 'text-bytes', 'token-file', 'progress', 'metrics-file'} <= set(found), found; "
        "loaded = [m for m in sys.modules if m.startswith('coretrain_')]; assert not loaded, loaded; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_first_party_plugins_come_from_their_distribution() -> None:
    found = discover()
    assert found["gpt"].distribution == "coretrain-plugins"
    assert found["progress"].autoload and found["metrics-file"].autoload and not found["gpt"].autoload


def _dist_info(site: Path, name: str) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[coretrain]\n{name} = {name}:Plugin\n")


def test_discovery_sees_a_distribution_installed_or_removed_after_the_last_scan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Entry points are read once per state of sys.path (a scan costs milliseconds, and a run
    asks for five groups): a new path, and a distribution added to or removed from a path
    already scanned, are seen by the next discovery (the directory's mtime changed)."""
    import shutil
    import time

    site = tmp_path / "site"
    site.mkdir()
    _dist_info(site, "early_plugin")
    assert "early_plugin" not in discover()
    monkeypatch.syspath_prepend(str(site))
    assert "early_plugin" in discover() and "late_plugin" not in discover()
    time.sleep(0.05)  # a directory's mtime moves on the filesystem's clock tick (ms), not per write
    _dist_info(site, "late_plugin")
    assert {"early_plugin", "late_plugin"} <= set(discover())
    time.sleep(0.05)
    shutil.rmtree(site / "early_plugin-1.0.dist-info")
    assert "early_plugin" not in discover() and "late_plugin" in discover()


def _enabled(tmp_path: Path, text: str) -> set[str]:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return set(enabled_tables(load_config(path).config, discover()))


def test_autoload_and_enabled_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CORETRAIN_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    built_in = {
        "progress",
        "metrics-file",
        "progress-file",
        "watchdog",
        "timers",
        "data-checks",
        "safetensors",
        "script-weights",
        "evaluation",
        "optimizer-overrides",
        "schedule",
        "console-log",
        "hf-datasets",
        "transformers-models",
        "streams",
        "resume-checks",
        "out-of-memory",
        "tokenizer",
    }
    assert _enabled(tmp_path, '[model]\nprovider = "gpt"\n') == {"gpt", *built_in}
    assert _enabled(tmp_path, "[plugins.progress]\nenabled = false\n") == built_in - {"progress"}
    monkeypatch.setenv("CORETRAIN_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert _enabled(tmp_path, "[plugins.progress]\nplain = true\n") == {"progress"}


def test_provider_settings_belong_in_options(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"'gpt' is the model provider; put its settings in \[model.options\]"):
        _enabled(tmp_path, '[model]\nprovider = "gpt"\n[plugins.gpt]\nn_layer = 2\n')


class Misspelled:
    @hookimpl
    def on_lgo(self) -> None: ...


def test_a_misspelled_hook_is_an_error_not_silence() -> None:
    plugins = Plugins()
    plugins.register("typo", Misspelled())
    with pytest.raises(
        UserError, match=r"plugin 'typo' implements hooks that do not exist: 'on_lgo' \(did you mean 'on_log'\?\)"
    ):
        plugins.check_pending()


class WrongArgs:
    @hookimpl
    def on_log(self, step: int, loss: float) -> None: ...


def test_an_implementation_with_unknown_arguments_is_rejected() -> None:
    with pytest.raises(
        UserError,
        match=r"plugin 'bad': hookimpl definition: on_log\(step.*Argument\(s\) {'loss'} are declared in the hookimpl",
    ):
        Plugins().register("bad", WrongArgs())


def test_a_missing_optional_dependency_names_the_extra_that_installs_it() -> None:
    from coretrain.errors import require

    assert require("json", needed_by="plugins.x", extra="x").dumps([]) == "[]"
    with pytest.raises(UserError, match=r"^plugins\.x needs not-installed: pip install 'coretrain-plugins\[x\]'$"):
        require("not_installed.sub", needed_by="plugins.x", extra="x")


def _pytest_in(directory: Path, site: Path) -> subprocess.CompletedProcess:
    """The package's own test suite, as its author runs it after installing it."""
    return run_cli(
        "-q",
        "-p",
        "no:cacheprovider",
        cwd=directory,
        env={"PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"},
        command=(sys.executable, "-m", "pytest"),
    )


def test_new_plugin_writes_a_package_that_installs_and_passes_its_tests(tmp_path: Path) -> None:
    made = run_cli("new-plugin", "loss-spikes", "--dir", str(tmp_path / "pkg"), cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    package = tmp_path / "pkg"
    assert (package / "coretrain_loss_spikes" / "__init__.py").is_file() and (package / "README.md").is_file()
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", site, package],
        check=True,
    )
    listing = run_cli("plugins", cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert "loss-spikes  coretrain-loss-spikes 0.1.0" in listing.stdout
    tests = _pytest_in(package, site)
    assert tests.returncode == 0 and "3 passed" in tests.stdout, tests.stdout + tests.stderr
    # what it writes passes the linters the project runs; coretrain's own code is read for its
    # types but not judged (MYPYPATH: this checkout is an editable install mypy cannot follow)
    written = ["coretrain_loss_spikes", "tests"]  # not pip's build/ copy
    linters = (
        ["ruff", "check", *written],
        ["ruff", "format", "--check", *written],
        ["mypy", "--strict", "--follow-imports=silent", *written],
    )
    for linter in linters:
        env = {**os.environ, "MYPYPATH": str(REPO)}
        checked = subprocess.run([sys.executable, "-m", *linter], cwd=package, capture_output=True, text=True, env=env)
        assert checked.returncode == 0, (linter, checked.stdout + checked.stderr)

    again = run_here("new-plugin", "loss-spikes", "--dir", str(package), cwd=tmp_path)  # its errors: in-process
    assert again.returncode == 2 and "exists and is not empty" in again.stderr
    bad = run_here("new-plugin", "Loss_Spikes", cwd=tmp_path)
    assert bad.returncode == 2 and "is not a plugin name" in bad.stderr and "Traceback" not in bad.stderr


def test_the_example_plugin_passes_its_own_tests_once_installed(site: Path) -> None:
    tests = _pytest_in(REPO / "examples" / "coretrain-hooklog", site)
    assert tests.returncode == 0 and "5 passed" in tests.stdout, tests.stdout + tests.stderr
