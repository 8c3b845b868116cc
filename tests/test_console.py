"""What a run prints: its own lines on the console; libraries' warnings and logs in run.log."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import coretrain_console_log as consolelog
import pytest

import coretrain
from coretrain.testing import tiny_config, write_config

NOISY_LIBRARY = """
import logging, warnings

own = logging.getLogger("noisylib.own")  # as torch's loggers: a handler of its own, not the root's
own.propagate = False
own.addHandler(logging.StreamHandler())

def build():
    warnings.warn("noisylib: this API is deprecated", FutureWarning)
    logging.getLogger("noisylib").warning("noisylib: falling back to the slow path")
    own.warning("noisylib: printed by its own handler")
"""


@pytest.fixture
def noisylib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``noisylib``, importable and counted as an installed library, as torchao and torch are
    (imported afresh by each test: its handler and its path are the test's)."""
    library = tmp_path / "lib"
    (library / "noisylib").mkdir(parents=True)
    (library / "noisylib" / "__init__.py").write_text(NOISY_LIBRARY)
    monkeypatch.syspath_prepend(str(library))
    monkeypatch.setattr(consolelog, "LIBRARY_DIRS", (*consolelog.LIBRARY_DIRS, str(library.resolve())))
    sys.modules.pop("noisylib", None)
    warnings.onceregistry.clear()  # console-log shows each warning once per process: here, once per test
    yield
    for name in ("noisylib", "mine"):  # the user module imports this test's noisylib
        sys.modules.pop(name, None)
    logging.getLogger("noisylib.own").handlers.clear()  # the next import adds its own again


MY_MODEL = """
import warnings
import noisylib
from coretrain.testing import tiny_model

def model():
    noisylib.build()
    warnings.warn("mine: check the learning rate", UserWarning)
    return tiny_model()
"""


def assert_in_run_log(log: Path) -> None:
    logged = log.read_text()
    assert "noisylib: this API is deprecated" in logged and "noisylib: falling back to the slow path" in logged
    assert "noisylib: printed by its own handler" in logged


def test_in_the_python_api_library_noise_goes_to_run_log_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noisylib: None
) -> None:
    """A script or notebook that set no logging up sees what `coretrain run` shows: the run's
    own lines, and the libraries' in run.log (Python's last-resort handler and torch-style
    handlers of their own would print them)."""
    (tmp_path / "mine.py").write_text(MY_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a fresh process's logging (pytest's handler aside)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), warnings.catch_warnings():
        no_evaluation = {"evaluation": {"enabled": False}}  # with an eval_interval: the run warns (once)
        train = {"train_iters": 2, "eval_interval": 1}
        result = coretrain.train(
            tiny_config(tmp_path / "out", model={"provider": "mine:model"}, train=train, plugins=no_evaluation)
        )
        logging.captureWarnings(False)
    assert result.exit_code == 0
    assert "noisylib" not in err.getvalue().replace("(noisylib)", ""), err.getvalue()
    assert f"3 line(s) from libraries (noisylib) are in {tmp_path / 'out' / 'run.log'}" in err.getvalue()
    assert_in_run_log(tmp_path / "out" / "run.log")
    said = [line for line in err.getvalue().splitlines() if "but no plugin evaluates" in line]
    assert len(said) == 1, (
        err.getvalue()
    )  # the run's own lines once (the stand-in for Python's last resort printed them again)


def test_torchs_trace_handler_still_gets_its_records_and_none_reach_run_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's structured-trace handler (``torch.__trace``: DEBUG records through a compilation,
    written to a file when TORCH_TRACE names a directory) has no stream until its first record,
    and without TORCH_TRACE removes itself then. console-log must leave it alone: it did not, and
    a compiled run's run.log held hundreds of empty ``torch.__trace DEBUG`` lines while torch went
    on building a trace record with its stack for every one."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    fresh = LazyTraceHandler(None)  # as torch makes it at import: here whatever earlier tests did to it
    monkeypatch.setattr(trace_log, "handlers", [fresh])
    monkeypatch.delenv("TORCH_TRACE", raising=False)
    (tmp_path / "traced.py").write_text(TRACED_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        result = coretrain.train(
            tiny_config(tmp_path / "out", model={"provider": "traced:model"}, train={"train_iters": 2})
        )
        logging.captureWarnings(False)
    sys.modules.pop("traced", None)
    assert result.exit_code == 0
    assert "torch.__trace" not in (tmp_path / "out" / "run.log").read_text()
    assert fresh not in trace_log.handlers  # it saw its first record and went, as torch meant


TRACED_MODEL = """
from torch._logging._internal import trace_structured
from coretrain.testing import tiny_model

def model():
    for _ in range(3):  # as dynamo does through a compilation
        trace_structured("artifact", metadata_fn=lambda: {"name": "x", "encoding": "string"}, payload_fn=lambda: "p")
    return tiny_model()
"""


def test_an_export_keeps_library_noise_in_the_runs_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, noisylib: None
) -> None:
    """`checkpoint export` imports a model's libraries (transformers, peft, torchao with it):
    console-log wraps the export hook, so their lines go to the run's run.log, not the console."""
    import noisylib as library  # imported before, as torch is: its handler exists when the export starts
    import pluggy
    from coretrain_checkpoint_command.hookspecs import ExportSpecs

    from coretrain import hookimpl

    class NoisyFormat:
        @hookimpl
        def export_model(self, to: Path) -> str:
            library.build()
            return f"wrote {to}"

    manager = pluggy.PluginManager("coretrain")
    manager.add_hookspecs(ExportSpecs)
    manager.register(consolelog.ConsoleLog(), name="console-log")
    manager.register(NoisyFormat(), name="noisy")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    err, run_dir = io.StringIO(), tmp_path / "run"
    with contextlib.redirect_stderr(err), warnings.catch_warnings():
        written = manager.hook.export_model(
            state={}, config={}, run_dir=run_dir, checkpoint=run_dir, export_format="x", to=tmp_path / "to", options={}
        )
        logging.captureWarnings(False)
    assert written == f"wrote {tmp_path / 'to'}"
    assert "noisylib" not in err.getvalue(), err.getvalue()
    assert_in_run_log(run_dir / "run.log")
    assert not [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]  # put back


def test_library_noise_goes_to_run_log_and_the_users_own_warning_stays_on_the_console(
    tmp_path: Path, cli: Any, monkeypatch: pytest.MonkeyPatch, noisylib: None
) -> None:
    (tmp_path / "mine.py").write_text(MY_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = write_config(
        tmp_path / "c.toml", tiny_config(tmp_path / "out", model={"provider": "mine:model"}, train={"train_iters": 2})
    )
    result = cli("run", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "noisylib:" not in result.stderr
    assert "mine: check the learning rate" in result.stderr
    assert f"3 line(s) from libraries (noisylib) are in {tmp_path / 'out' / 'run.log'}" in result.stderr
    logged = (tmp_path / "out" / "run.log").read_text()
    assert "noisylib: this API is deprecated" in logged and "noisylib: falling back to the slow path" in logged
    assert "noisylib: printed by its own handler" in logged
    assert "mine: check the learning rate" in logged


@pytest.mark.slow  # a real process: its file descriptor 2 is what C++ code writes to
def test_torchs_cpp_lines_go_to_run_log_and_python_s_own_stay_on_the_console(tmp_path: Path, site: Path) -> None:
    """A store client that cannot connect makes torch's C++ code write warnings and a stack of
    ``frame #`` lines straight to file descriptor 2: they land in run.log; the run's own lines
    (and its error lines, were there any) still reach the console."""
    from conftest import run_cli

    plugins = {"store-noise": {"at_step": 2}}
    config = write_config(tmp_path / "c.toml", tiny_config(tmp_path / "out", train={"train_iters": 4}, plugins=plugins))
    result = run_cli("run", str(config), cwd=tmp_path, env={"PYTHONPATH": str(site)})
    assert result.returncode == 0, result.stderr
    assert "frame #" not in result.stderr and "[c10d]" not in result.stderr, result.stderr[-3000:]
    assert "completed at step 4" in result.stdout + result.stderr
    logged = (tmp_path / "out" / "run.log").read_text()
    assert "[c10d] The client socket has timed out" in logged and "frame #0" in logged
