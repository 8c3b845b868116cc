"""``comet``: the run in Comet — params, metrics by step, tags, the config as an asset (rank 0).

Online with ``COMET_API_KEY`` (or ``api_key``); ``offline = true`` writes an offline archive
(``<output_dir>/comet/<key>.zip``, upload it later with ``comet upload``). comet-ml writes that
archive only in ``Experiment.end()``: a process killed by a plain SIGTERM leaves an empty zip.
Here ``end()`` runs in ``on_train_end``, which the loop calls on every way a run ends, and the
core's signal handler (on by default) turns SIGTERM into a checkpoint and a normal return, so
a preempted job's archive holds everything up to its last step.

A :class:`~coretrain_backends.LoggingBackend`: after every other plugin, rank 0 only, closed on
every way a run ends. The experiment key is saved in checkpoints, so a resumed run continues the
same experiment. comet-ml's framework auto-logging is off: every value comes from the loop.
Needs ``pip install 'coretrain-plugins[comet]'``.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

from attrs import define, field
from coretrain_backends import LoggingBackend

from coretrain import Outcome, Run, UserError, hookimpl, require

log = logging.getLogger("coretrain")

QUIET = {  # comet-ml's automatic logging would patch torch and capture the terminal; the loop logs
    "log_code": False,
    "log_graph": False,
    "auto_param_logging": False,
    "auto_metric_logging": False,
    "parse_args": False,
    "auto_output_logging": False,
    "log_git_metadata": False,
    "log_git_patch": False,
    "display_summary_level": 0,
}


def _import_comet(offline: bool) -> Any:
    os.environ.setdefault("COMET_DISABLE_AUTO_LOGGING", "1")  # no "import comet_ml before torch" patching
    if offline:  # offline means no network: not even comet-ml's own crash reports to its Sentry
        os.environ.setdefault("COMET_ERROR_TRACKING_ENABLE", "false")
    comet_ml = require("comet_ml", needed_by="plugins.comet", extra="comet")
    _through_python_logging("comet_ml")
    return comet_ml


def _through_python_logging(name: str) -> None:
    """A library that prints through a terminal handler of its own (comet_ml's "COMET INFO:"
    lines): its records go through Python logging's root instead, where the run's handlers
    decide (``console-log`` keeps a library's lines below ERROR in run.log, off the console)."""
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            logger.removeHandler(handler)
    logger.propagate = True


@define(kw_only=True)
class Comet(LoggingBackend):
    """Log the run to Comet, online or as an offline archive."""

    offline: bool = False
    """Write an offline archive instead of talking to comet.com."""
    offline_directory: str | None = None
    """Where offline archives go; unset = <run.output_dir>/comet."""
    api_key: str | None = field(default=None, metadata={"secret": True})
    """Unset = COMET_API_KEY or comet's config file (online only); a credential: never written
    to config.toml, a checkpoint or the experiment's parameters (COMET_API_KEY is better still)."""
    project_name: str | None = None
    """Unset = COMET_PROJECT_NAME, else comet's default project."""
    workspace: str | None = None
    """Comet workspace; unset: the API key's default."""
    experiment_name: str | None = None
    """Unset = run.name."""
    tags: list[str] = field(factory=list)
    """Tags put on the experiment."""
    log_env_details: bool = True
    """Let comet-ml record host, CPU, GPU and package details."""
    log_checkpoints: bool = False
    """Upload every committed checkpoint as a model (large: off by default)."""
    _experiment: Any = field(default=None, init=False, repr=False)

    def open(self, run: Run) -> None:
        comet_ml = _import_comet(self.offline)
        if "SIGTERM" not in run.config.train.exit_signals or not run.config.train.exit_signal_handler:
            log.warning(
                "comet: SIGTERM is not handled (train.exit_signal_handler / exit_signals); a job killed "
                "by SIGTERM leaves its comet data unwritten"
            )
        options: dict[str, Any] = {
            **QUIET,
            "project_name": self.project_name,
            "workspace": self.workspace,
            "log_env_details": self.log_env_details,
        }
        if self.offline:
            directory = Path(self.offline_directory) if self.offline_directory else Path(run.output_dir) / "comet"
            directory.mkdir(parents=True, exist_ok=True)
            options["offline_directory"] = str(directory)
            kind = comet_ml.ExistingOfflineExperiment if self.resumed_id else comet_ml.OfflineExperiment
        else:
            if not (self.api_key or os.environ.get("COMET_API_KEY") or comet_ml.get_config("comet.api_key")):
                raise UserError(
                    "plugins.comet: no Comet API key; set COMET_API_KEY, plugins.comet.api_key, "
                    "or log offline with plugins.comet.offline = true"
                )
            options["api_key"] = self.api_key
            kind = comet_ml.ExistingExperiment if self.resumed_id else comet_ml.Experiment
        if self.resumed_id:
            options["experiment_key"] = self.resumed_id
        experiment = kind(**options)
        experiment.set_name(self.experiment_name or run.config.run.name)
        if self.tags:
            experiment.add_tags(list(self.tags))
        from coretrain import config_as_dict

        experiment.log_parameters(config_as_dict(run.config))
        experiment.log_other("world_size", run.dist.world_size)
        experiment.log_other("start_step", run.state.step)
        config_file = Path(run.output_dir) / "config.toml"
        if config_file.is_file():
            experiment.log_asset(str(config_file), file_name="config.toml", overwrite=True)
        self._experiment = experiment

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._experiment.log_metrics(metrics, step=step)

    def run_id(self) -> str | None:
        key: str | None = self._experiment.get_key()
        return key

    @hookimpl(trylast=True)
    def on_checkpoint_saved(self, step: int, path: str) -> None:
        if self._experiment is not None and self.log_checkpoints:
            self._experiment.log_model("checkpoints", path, file_name=f"step_{step}", overwrite=True)

    @hookimpl(trylast=True)
    def on_signal(self, signum: int) -> None:
        if self._experiment is not None:
            self._experiment.log_other("signal", signal.Signals(signum).name)

    def close(self, outcome: Outcome) -> None:
        experiment, self._experiment = self._experiment, None
        experiment.log_other("outcome", outcome)
        experiment.end()  # offline: this is what writes the archive
