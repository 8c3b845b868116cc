"""``deterministic``: torch's deterministic algorithms and the libraries' settings for the run's
length, and two runs with DataLoader workers that repeat bit for bit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from coretrain import Run, UserError, hookimpl
from coretrain.testing import run_steps

SETTINGS = ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO")


class SeesTheSettings:
    """What a plugin building the model sees: torch's flags and the environment."""

    seen: dict[str, object] = {}

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        self.seen = {
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
            **{name: os.environ.get(name) for name in SETTINGS},
        }


def test_two_runs_with_workers_repeat_bit_for_bit_with_the_settings_on_for_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    runs = []
    for name in ("first", "second"):
        probe = SeesTheSettings()
        config = {"data": {"num_workers": 2}, "model": {"options": {"dropout": 0.1}}}
        result = run_steps(
            tmp_path / name, steps=6, config=config, tables={"deterministic": {}}, plugins={"probe": probe}
        )
        runs.append([(row["step"], row["loss"]) for row in result.metrics])
        assert probe.seen == {
            "deterministic": True,
            "cudnn": (True, False),
            "NCCL_ALGO": "Ring",
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
            "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
        }
    assert runs[0] == runs[1] and len(runs[0]) == 3  # the same floats, not close ones
    assert not torch.are_deterministic_algorithms_enabled()  # put back after the run
    assert not any(name in os.environ for name in SETTINGS)


def test_an_nccl_algorithm_that_is_not_deterministic_is_one_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NCCL_ALGO", "NVLS")
    with pytest.raises(UserError, match=r"plugins.deterministic: the environment sets NCCL_ALGO='NVLS'"):
        run_steps(tmp_path, steps=1, tables={"deterministic": {}})
    assert not torch.are_deterministic_algorithms_enabled()


class FailsToBuild:
    """A model provider that refuses, as a user's may (a missing file, a bad option)."""

    @hookimpl(tryfirst=True)
    def provide_model(self) -> None:
        raise UserError("model.options.path: no such directory (the provider says)")


@pytest.mark.parametrize("failure", ["provider", "refused-resume"])
def test_a_run_that_fails_in_set_up_leaves_the_process_as_it_found_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """What configure_run changed is put back by close_run however far the run got, so a
    notebook's next run is not silently deterministic, nor its library lines sent to a file."""
    import logging

    for name in SETTINGS:
        monkeypatch.delenv(name, raising=False)
    handlers = list(logging.getLogger().handlers)
    tables = {"deterministic": {}, "console-log": {}}
    if failure == "provider":
        with pytest.raises(UserError, match="the provider says"):
            run_steps(tmp_path, steps=2, tables=tables, plugins={"fails": FailsToBuild()})
    else:
        run_steps(tmp_path, steps=2, tables=tables)
        with pytest.raises(UserError, match="would change what it means"):  # resume-checks: another model
            run_steps(tmp_path, steps=4, tables=tables, config={"model": {"options": {"dropout": 0.1}}})
    assert not torch.are_deterministic_algorithms_enabled()
    assert not any(name in os.environ for name in SETTINGS)
    assert logging.getLogger().handlers == handlers  # run.log's handler closed and gone
