"""``mlflow``: the run in an MLflow tracking store — params, metrics by step, the config (rank 0).

By default the store is a SQLite file in the output dir (``<output_dir>/mlflow.db``, artifacts
in ``<output_dir>/mlartifacts``); ``tracking_uri`` (or ``MLFLOW_TRACKING_URI``) points it at a
server or another database. Open it with ``mlflow ui --backend-store-uri sqlite:///…/mlflow.db``.

A :class:`~coretrain_backends.LoggingBackend` (after every other plugin, rank 0 only). The
MLflow run id is saved in checkpoints, so a resumed job logs into the same run; the run ends
FINISHED, KILLED (signal) or FAILED (exception) on every way a run ends. Needs
``pip install 'coretrain-plugins[mlflow]'`` (mlflow-skinny: the client and its SQL store without the
server's dependencies; ``pip install mlflow`` for the UI).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from attrs import define, field
from coretrain_backends import LoggingBackend

from coretrain import Outcome, Run, require

STATUS = {
    "completed": "FINISHED",
    "exit_interval": "FINISHED",
    "exit_duration": "FINISHED",
    "stopped": "FINISHED",
    "signal": "KILLED",
    "error": "FAILED",
}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> {"train.lr": "0.001", ...}: MLflow params are flat strings."""
    flat: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = str(value)
    return flat


def _exists(client: Any, run_id: str) -> bool:
    """Whether this store has the run (a resumed job may point at another store)."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_run(run_id)
    except MlflowException:
        return False
    return True


@define(kw_only=True)
class MLflow(LoggingBackend):
    """Log the run to MLflow (a local SQLite store unless told otherwise)."""

    tracking_uri: str | None = None
    """Unset = MLFLOW_TRACKING_URI, else sqlite:///<run.output_dir>/mlflow.db."""
    experiment_name: str | None = None
    """Unset = run.name."""
    run_name: str | None = None
    """Unset = run.name."""
    tags: dict[str, str] = field(factory=dict)
    """Tags set on the MLflow run."""
    _client: Any = field(default=None, init=False, repr=False)
    _run_id: str | None = field(default=None, init=False, repr=False)

    def open(self, run: Run) -> None:
        MlflowClient = require("mlflow", needed_by="plugins.mlflow", extra="mlflow").MlflowClient
        from mlflow.entities import Param

        output_dir = Path(run.output_dir).resolve()
        output_dir.mkdir(parents=True, exist_ok=True)
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{output_dir / 'mlflow.db'}"
        client = MlflowClient(tracking_uri=uri)
        if self.resumed_id is not None and _exists(client, self.resumed_id):
            self._run_id = self.resumed_id
            client.update_run(self._run_id, status="RUNNING")
        else:
            name = self.experiment_name or run.config.run.name
            experiment = client.get_experiment_by_name(name)
            experiment_id = (
                experiment.experiment_id
                if experiment
                else client.create_experiment(name, artifact_location=(output_dir / "mlartifacts").as_uri())
            )
            tags = {"world_size": str(run.dist.world_size), **self.tags}
            self._run_id = client.create_run(
                experiment_id, run_name=self.run_name or run.config.run.name, tags=tags
            ).info.run_id
            from coretrain import config_as_dict

            params = [Param(key, value[:6000]) for key, value in flatten(config_as_dict(run.config)).items()]
            for start in range(0, len(params), 100):  # MLflow's limit per batch
                client.log_batch(self._run_id, params=params[start : start + 100])
        config_file = output_dir / "config.toml"  # each job's own (a resumed job may change settings)
        if config_file.is_file():
            folder = f"resumed_at_step_{run.state.step:08d}" if run.state.step else None
            client.log_artifact(self._run_id, str(config_file), artifact_path=folder)
        self._client = client

    def write(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._client.log_batch(
            self._run_id, metrics=[Metric(name, value, now, step) for name, value in metrics.items()]
        )

    def run_id(self) -> str | None:
        return self._run_id

    def close(self, outcome: Outcome) -> None:
        client, self._client = self._client, None
        client.set_terminated(self._run_id, status=STATUS.get(outcome, "FINISHED"))
