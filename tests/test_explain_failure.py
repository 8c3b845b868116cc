"""An exception that ends a run is told in one line by the plugin that knows it (explain_failure)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from coretrain import Run, hookimpl
from coretrain.errors import RunFailure
from coretrain.testing import TinyRegression, run_steps


class FailsAt(TinyRegression):
    """The tiny model, whose forward at call ``at`` raises ``error``."""

    def __init__(self, at: int, error: BaseException) -> None:
        super().__init__()
        self.calls, self.at, self.error = 0, at, error

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return super().forward(x, y)


class Provides:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    @hookimpl(tryfirst=True)
    def provide_model(self) -> torch.nn.Module:
        return self.model


def test_out_of_memory_is_one_line_with_the_sizes(tmp_path: Path) -> None:
    model = FailsAt(3, MemoryError())
    with pytest.raises(RunFailure) as failure:
        run_steps(tmp_path, 6, plugins={"model": Provides(model)}, tables={"out-of-memory": {}})
    assert str(failure.value) == (
        "out of memory at step 3 on cpu (micro_batch_size 8, model 0.0M parameters): MemoryError; lower "
        "train.micro_batch_size (global_batch_size stays, through gradient accumulation) or the model size"
    )
    assert isinstance(failure.value.__cause__, MemoryError)  # kept for the traceback file


def test_without_the_plugin_the_exception_is_the_failure(tmp_path: Path) -> None:
    with pytest.raises(MemoryError):
        run_steps(tmp_path, 6, plugins={"model": Provides(FailsAt(3, MemoryError()))})


def test_errors_it_does_not_know_are_left_as_they_are(tmp_path: Path) -> None:
    model = FailsAt(2, ValueError("a bad batch"))
    with pytest.raises(ValueError, match="a bad batch"):
        run_steps(tmp_path, 6, plugins={"model": Provides(model)}, tables={"out-of-memory": {}})


class NamesNaN:
    """A third party's explanation of its own kind of failure."""

    @hookimpl
    def explain_failure(self, run: Run, error: BaseException) -> str | None:
        known = isinstance(error, FloatingPointError)
        return f"step {run.state.step + 1}: {error} (see our runbook)" if known else None


def test_a_plugin_explains_its_own_kind_of_failure(tmp_path: Path) -> None:
    model = FailsAt(4, FloatingPointError("overflow in the router"))
    plugins = {"model": Provides(model), "runbook": NamesNaN()}
    with pytest.raises(RunFailure, match=r"^step 4: overflow in the router \(see our runbook\)$"):
        run_steps(tmp_path, 6, plugins=plugins, tables={"out-of-memory": {}})
