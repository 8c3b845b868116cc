"""The Python API: coretrain.train(config_or_path, overrides=...) returns what the run did."""

from __future__ import annotations

import builtins
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

import coretrain
from coretrain import UserError
from coretrain.testing import tiny_config, write_config


def test_a_dict_config_trains_and_returns_the_outcome_the_metrics_and_the_history(tmp_path: Path) -> None:
    result = coretrain.train(tiny_config(tmp_path / "out"), overrides={"train.train_iters": 4})
    assert (result.outcome, result.exit_code, result.step) == ("completed", 0, 4)
    assert result.output_dir == tmp_path / "out"
    assert [row["step"] for row in result.history] == [2, 4, 4]  # two logs, then the final validation
    assert result.metrics["loss"] == result.history[1]["loss"]
    assert result.metrics["valid/loss"] == result.history[2]["valid/loss"]
    assert (tmp_path / "out" / "checkpoints" / "step_00000004").is_dir()
    assert result.checkpoints == {}  # no plugin named one


def test_a_path_with_set_texts_and_a_second_call_resumes(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.toml", tiny_config(tmp_path / "out", train={"train_iters": 4}))
    first = coretrain.train(path)
    again = coretrain.train(str(path), overrides=["train.train_iters=8"])
    assert (first.step, again.step) == (4, 8)
    assert [row["step"] for row in again.history if "loss" in row] == [6, 8]


def test_a_dict_may_extend_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_config(tmp_path / "base.toml", tiny_config(tmp_path / "out", train={"train_iters": 4}))
    monkeypatch.chdir(tmp_path)
    result = coretrain.train({"extends": "base.toml", "train": {"train_iters": 2}})
    assert result.step == 2


def test_a_dicts_extends_is_checked_as_a_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dict's ``extends`` that is no file name (a number, a list holding one) is the file's one
    error line, not a TypeError from inside the loader; a missing file names where it was looked for."""
    monkeypatch.chdir(tmp_path)
    for extends, got in ((5, "5 (integer)"), (["base.toml", 5], "['base.toml', 5] (list)")):
        with pytest.raises(
            UserError, match=rf"^extends: expected a file name or a list of file names, got {re.escape(got)}$"
        ):
            coretrain.load({"extends": extends})
    with pytest.raises(
        UserError, match=rf"^extends: 'base.toml' not found \(looked for {re.escape(str(tmp_path))}/base.toml\)$"
    ):
        coretrain.load({"extends": "base.toml"})


def test_a_mistake_in_a_dict_that_extends_a_file_is_named_at_the_dicts_key_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dict's own keys are no line of the file it extends: its typos and wrong values are
    named by their key path in the dict; the file's own mistakes keep their file and line."""
    base = tiny_config(tmp_path / "out", train={"train_iters": 4, "log_interval": 2})
    write_config(tmp_path / "base.toml", base)
    monkeypatch.chdir(tmp_path)
    for layer, expected in [
        (
            {"train": {"lgo_interval": 2}},
            "\n  the config: train.lgo_interval: unknown key (did you mean 'log_interval'?)",
        ),
        ({"train": {"log_interval": "2"}}, "\n  the config: train.log_interval: expected an integer, got '2' (string)"),
    ]:
        with pytest.raises(UserError) as caught:
            coretrain.load({"extends": "base.toml", **layer})
        assert str(caught.value).endswith(expected), str(caught.value)
    write_config(tmp_path / "base.toml", {**base, "train": {**base["train"], "eval_iters": "x"}})
    line = next(
        n for n, text in enumerate((tmp_path / "base.toml").read_text().splitlines(), 1) if "eval_iters" in text
    )
    with pytest.raises(UserError, match=f"base.toml:{line}: train.eval_iters: expected an integer"):
        coretrain.load({"extends": "base.toml", "train": {"log_interval": 1}})


def test_a_stop_is_the_outcome_not_an_exception(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path / "out",
        train={"train_iters": 20, "eval_interval": 2, "eval_iters": 1},
        plugins={"early-stopping": {"patience": 1, "min_delta": 100.0}},
    )
    result = coretrain.train(config)
    assert (result.outcome, result.exit_code, result.step) == ("stopped", 0, 4)


def test_a_mistake_in_the_overrides_is_a_user_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(
        UserError, match=r"overrides\['optimizer\.lrr'\]: optimizer\.lrr: unknown key \(did you mean 'lr'"
    ):
        coretrain.train(tiny_config(tmp_path / "out"), overrides={"optimizer.lrr": 0.1})


class ZMQInteractiveShell:
    """What rich looks for to know it runs in Jupyter: IPython's kernel shell, by class name."""


def test_the_progress_view_is_live_in_jupyter_with_ipywidgets(monkeypatch: pytest.MonkeyPatch) -> None:
    """rich knows a notebook by IPython's shell class; the progress plugin asks rich, and draws
    live only where rich can (ipywidgets importable)."""
    import types

    from coretrain_progress import in_notebook

    assert not in_notebook()
    monkeypatch.setattr(builtins, "get_ipython", ZMQInteractiveShell, raising=False)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # not installed: import fails
    assert not in_notebook()
    monkeypatch.setitem(sys.modules, "ipywidgets", types.ModuleType("ipywidgets"))
    assert in_notebook()


def test_a_notebook_without_ipywidgets_shows_the_step_lines_and_the_last_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    monkeypatch.setattr(builtins, "get_ipython", ZMQInteractiveShell, raising=False)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)
    config = tiny_config(tmp_path / "out", train={"train_iters": 4, "log_interval": 2})
    result = coretrain.train(config, plugins=None)
    out = capsys.readouterr()
    assert result.outcome == "completed"
    assert "step 2/4" in out.out and "step 4/4" in out.out and "completed at step 4" in out.out + out.err
    assert 'install "ipywidgets"' not in out.out + out.err  # rich's warning, all a notebook showed before


@pytest.mark.slow  # 20 quickstart steps
def test_the_readme_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> None:
    readme = (REPO / "docs" / "guides" / "python-api.md").read_text()
    block = re.search(r"<!-- tests/test_api.py runs this block -->\n```python\n(.*?)```", readme, re.S)
    assert block is not None
    # one torch thread, as every test process here (the example's 2 spin when the cores are busy)
    code = block.group(1).replace('"runs/notebook"', f'{str(tmp_path / "notebook")!r}, "run.threads": 1')
    monkeypatch.chdir(REPO)
    namespace: dict[str, Any] = {}
    exec(compile(code, "docs/guides/python-api.md", "exec"), namespace)
    result = namespace["result"]
    assert (result.outcome, result.step) == ("completed", 20)
    assert namespace["steps"] == [10, 20]
    assert "completed 20" in capsys.readouterr().out


def test_a_model_and_data_defined_in_a_notebooks_main_train_by_import_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """The guide's block, run as a notebook runs a cell: in the module ``__main__`` (the kernel's
    namespace), whose functions the config names as ``__main__:NAME``; the loss falls."""
    import types

    guide = (REPO / "docs" / "guides" / "python-api.md").read_text()
    block = re.search(
        r"<!-- tests/test_api.py runs this block as a notebook's __main__ -->\n```python\n(.*?)```", guide, re.S
    )
    assert block is not None
    code = block.group(1).replace('"runs/cell"}', f'{str(tmp_path / "cell")!r}, "threads": 1}}')
    notebook = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    exec(compile(code, "docs/guides/python-api.md", "exec"), notebook.__dict__)
    result = notebook.result
    assert (result.outcome, result.step) == ("completed", 60)
    losses = [row["loss"] for row in result.history if "loss" in row]
    assert len(losses) == 3 and losses[-1] < losses[0] / 2, losses
    assert "valid/loss" in result.metrics
    assert f"{result.metrics['loss']} {result.metrics['valid/loss']}" in capsys.readouterr().out
