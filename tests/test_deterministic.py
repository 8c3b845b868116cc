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
