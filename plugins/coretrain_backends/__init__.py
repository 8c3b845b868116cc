"""The contract of a logging backend (TensorBoard, Comet, MLflow, W&B, yours), written once: a
library of coretrain-plugins (the core's ``coretrain.LoggingBackend`` until 1.0, which still
finds it, with a deprecation warning). Nothing of the core needs it: it is a plugin of plugins.

A backend subclasses :class:`LoggingBackend` and fills in ``open``, ``write`` and ``close``;
the hooks here guarantee what every backend must do:

- ``trylast`` on every hook, so it records the metrics every other plugin added;
- only rank 0 opens it, so a job on N ranks makes one run, not N;
- ``close(outcome)`` runs on every way a run ends — completed, exit condition, signal,
  exception — because ``on_train_end`` does (offline archives are written there);
- the backend's own id of its run (``run_id()``) is saved in checkpoints and handed back as
  ``resumed_id`` before ``open``, so a resumed job continues that run instead of starting one.
"""

from __future__ import annotations

from typing import Any

from coretrain import Outcome, Run, hookimpl

__all__ = ["LoggingBackend"]


class LoggingBackend:
    """Base class for plugins that send the run's metrics somewhere else."""

    _opened = False
    resumed_id: str | None = None
    """The run id saved by the checkpoint this job resumed from; None on a fresh start."""

    def open(self, run: Run) -> None:
        """Start the backend's run (rank 0 only): create it, log the config."""
        raise NotImplementedError

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Record one ``on_log`` or ``on_eval`` set of metrics."""
        raise NotImplementedError

    def close(self, outcome: Outcome) -> None:
        """Flush and end the backend's run; ``outcome`` is on_train_end's."""
        raise NotImplementedError

    def run_id(self) -> str | None:
        """The backend's id of the open run (experiment key, run id); None = nothing to continue."""
        return None

    @hookimpl
    def on_resume(self, state: dict[str, Any]) -> None:
        self.resumed_id = state.get("run_id")

    @hookimpl
    def on_checkpoint(self) -> dict[str, Any] | None:
        run_id = self.run_id() if self._opened else None
        return {"run_id": run_id} if run_id else None

    @hookimpl(trylast=True)
    def on_train_start(self, run: Run) -> None:
        if run.dist.is_main:
            self.open(run)
            self._opened = True

    @hookimpl(trylast=True)
    def on_log(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        if self._opened and not run.config.train.skip_train_metrics_log:
            self.write(step, metrics)

    @hookimpl(trylast=True)
    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        if self._opened:
            self.write(step, metrics)

    @hookimpl(trylast=True)
    def on_train_end(self, outcome: Outcome) -> None:
        if self._opened:
            self._opened = False
            self.close(outcome)
