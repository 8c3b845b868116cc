"""What a run prints: its own lines on the console; libraries' warnings and logs in run.log."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import coretrain_console_log as consolelog
import pytest

from coretrain.testing import tiny_config, write_config


def test_library_noise_goes_to_run_log_and_the_users_own_warning_stays_on_the_console(
    tmp_path: Path, cli: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    library = tmp_path / "lib"
    (library / "noisylib").mkdir(parents=True)
    (library / "noisylib" / "__init__.py").write_text(
        textwrap.dedent(
            """
            import logging, warnings

            own = logging.getLogger("noisylib.own")  # as torch's loggers: a handler of its own, not the root's
            own.propagate = False
            own.addHandler(logging.StreamHandler())

            def build():
                warnings.warn("noisylib: this API is deprecated", FutureWarning)
                logging.getLogger("noisylib").warning("noisylib: falling back to the slow path")
                own.warning("noisylib: printed by its own handler")
            """
        )
    )
    (tmp_path / "mine.py").write_text(
        textwrap.dedent(
            """
            import warnings
            import noisylib
            from coretrain.testing import tiny_model

            def model():
                noisylib.build()
                warnings.warn("mine: check the learning rate", UserWarning)
                return tiny_model()
            """
        )
    )
    monkeypatch.syspath_prepend(str(library))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(consolelog, "LIBRARY_DIRS", (*consolelog.LIBRARY_DIRS, str(library.resolve())))
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
