"""``tensorboard``: every logged and evaluated metric as a TensorBoard scalar (rank 0).

A :class:`~coretrain_backends.LoggingBackend`: after every other plugin, rank 0 only, closed on
every way a run ends. Needs the ``tensorboard`` package: ``pip install 'coretrain-plugins[tensorboard]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attrs import define, field
from coretrain_backends import LoggingBackend

from coretrain import Outcome, Run, require


@define(kw_only=True)
class TensorBoard(LoggingBackend):
    """Scalars to TensorBoard event files via torch's SummaryWriter."""

    log_dir: str | None = None
    """Where event files go; unset = <run.output_dir>/tensorboard."""
    flush_secs: int = 30
    """How often the writer flushes to disk on its own."""
    _writer: Any = field(default=None, init=False, repr=False)

    def open(self, run: Run) -> None:
        SummaryWriter = require(
            "torch.utils.tensorboard", needed_by="plugins.tensorboard", extra="tensorboard", package="tensorboard"
        ).SummaryWriter
        log_dir = Path(self.log_dir) if self.log_dir else Path(run.output_dir) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(log_dir), flush_secs=self.flush_secs, purge_step=run.state.step + 1)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)

    def close(self, outcome: Outcome) -> None:
        self._writer.flush()
        self._writer.close()
