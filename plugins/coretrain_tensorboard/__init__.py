"""``tensorboard``: every logged and evaluated metric as a TensorBoard scalar (rank 0).

A logging backend: its hooks are ``trylast`` so it records what every other plugin added to
the metrics, it writes only on rank 0, and it is flushed and closed on every way a run ends
(``on_train_end`` runs after errors and signals too). Needs the ``tensorboard`` package:
``pip install 'coretrain[tensorboard]'``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attrs import define, field

from coretrain import hookimpl


@define(kw_only=True)
class TensorBoard:
    """Scalars to TensorBoard event files via torch's SummaryWriter."""

    log_dir: str | None = None
    """Where event files go; unset = <run.output_dir>/tensorboard."""
    flush_secs: int = 30
    """How often the writer flushes to disk on its own."""
    _writer: Any = field(default=None, init=False, repr=False)

    @hookimpl(trylast=True)
    def on_train_start(self, run: Any) -> None:
        if not run.dist.is_main:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from coretrain.errors import UserError

            raise UserError("plugins.tensorboard needs the tensorboard package: "
                            "pip install 'coretrain[tensorboard]'") from None
        log_dir = Path(self.log_dir) if self.log_dir else Path(run.output_dir) / "tensorboard"
        self._writer = SummaryWriter(log_dir=str(log_dir), flush_secs=self.flush_secs, purge_step=run.state.step + 1)

    def _write(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is not None:
            for name, value in metrics.items():
                self._writer.add_scalar(name, value, global_step=step)

    @hookimpl(trylast=True)
    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        self._write(step, metrics)

    @hookimpl(trylast=True)
    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        self._write(step, metrics)

    @hookimpl(trylast=True)
    def on_train_end(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
