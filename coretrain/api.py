"""The Python API: ``coretrain.train(config_or_path, overrides={...})`` for notebooks and scripts.

The same run as ``coretrain run`` — the same config, plugins, checkpoints and resume — but in
the caller's process, returning a :class:`TrainResult` instead of an exit code and raising
instead of printing ``error:`` lines (a notebook shows the exception; ``UserError`` says
what to fix). Progress shows as the ``progress`` plugin decides: its live view on a terminal
or in Jupyter, plain lines otherwise. Ctrl-C (a notebook's interrupt) stops gracefully with a
checkpoint; a second one raises ``KeyboardInterrupt`` instead of killing the kernel.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attrs import define, field

from coretrain import pluginmanager
from coretrain.checkpoint.layout import named_links
from coretrain.configload import LoadedConfig, Overrides, load_config, load_config_data
from coretrain.hookspecs import Outcome
from coretrain.markers import hookimpl

if TYPE_CHECKING:
    from coretrain.pluginmanager import Plugins
    from coretrain.run import Run


@define
class TrainResult:
    """What a run did: how it ended, where its files are, and what it logged."""

    outcome: Outcome
    """"completed", "stopped" (a plugin: early stopping, guards), "exit_interval",
    "exit_duration" or "signal"."""
    exit_code: int
    """What ``coretrain run`` would have exited with."""
    step: int
    output_dir: Path
    metrics: dict[str, float]
    """The last value of every metric logged or evaluated (``loss``, ``valid/loss``, ...)."""
    history: list[dict[str, float]] = field(repr=False)
    """Every ``on_log`` and ``on_eval`` row, with its ``step``, as metrics.jsonl has them."""
    checkpoints: dict[str, Path] = field(factory=dict)
    """The checkpoints plugins named, by name: each link a plugin left beside the step
    directories that leads to one of them (keep-best's ``"best"``)."""

    @property
    def best_checkpoint(self) -> Path | None:
        """Deprecated: ``checkpoints.get("best")``."""
        warnings.warn('best_checkpoint is deprecated: use result.checkpoints.get("best")', DeprecationWarning, 2)
        return self.checkpoints.get("best")


class ResultRecorder:
    """A plugin of the API's own, registered for the one run: keeps what the run logged."""

    def __init__(self) -> None:
        self.history: list[dict[str, float]] = []
        self.outcome: Outcome = "error"

    @hookimpl(trylast=True)
    def on_log(self, step: int, metrics: dict[str, float]) -> None:
        self.history.append({"step": step, **metrics})

    on_eval = on_log  # an evaluation's metrics are kept the same way

    @hookimpl
    def on_train_end(self, outcome: Outcome) -> None:
        self.outcome = outcome

    def result(self, exit_code: int, step: int, output_dir: Path) -> TrainResult:
        """The run's outcome with the last value of each metric it logged."""
        metrics = {name: value for row in self.history for name, value in row.items() if name != "step"}
        links = named_links(output_dir / "checkpoints")
        return TrainResult(self.outcome, exit_code, step, output_dir, metrics, self.history, links)


def train(
    config: str | Path | Mapping[str, Any], overrides: Overrides = (), plugins: Mapping[str, object] | None = None
) -> TrainResult:
    """Train as ``coretrain run`` would, in this process.

    ``config``: a TOML file's path, or the same tables as a dict (``{"extends": "base.toml",
    "optimizer": {"lr": 3e-4}}``); ``overrides``: ``{"optimizer.lr": 3e-4}`` (Python values)
    or ``--set`` texts; ``plugins``: objects with ``@hookimpl`` methods to register for this
    run by name (Lightning's ``callbacks=[...]``). Raises :class:`coretrain.UserError` for a
    mistake in the config or the data, and whatever a failing plugin or the model raised.
    """
    from coretrain.session import run_session, session_plugins
    from coretrain.signals import SignalWatcher

    loaded = load(config, overrides)
    recorder = ResultRecorder()
    manager = session_plugins(loaded, {**(plugins or {}), "coretrain-api-result": recorder})
    in_main_thread = threading.current_thread() is threading.main_thread()  # only it may take signals
    signals = SignalWatcher(impatient="raise") if in_main_thread else SignalWatcher([])
    with _console_logging(loaded.config.run.log_level), signals:
        code, run = run_session(loaded, manager, signals)
    return recorder.result(code, run.state.step, Path(loaded.config.output_dir))


def load(config: str | Path | Mapping[str, Any], overrides: Overrides = ()) -> LoadedConfig:
    """The config as a run would see it (``.config``: the structured :class:`Config`), without
    running anything; raises :class:`coretrain.UserError` for a mistake."""
    if isinstance(config, Mapping):
        return load_config_data(config, overrides)
    return load_config(config, overrides)


def prepare(config: str | Path | Mapping[str, Any], overrides: Overrides = ()) -> Run:
    """The run as ``coretrain run`` builds it on these ranks — every check before its first step
    (layout, batch sizes, providers and their options, splits, model, optimizer, the plan of
    steps) — without training or writing a file: ``coretrain config validate``, a notebook."""
    from coretrain.build import build_run, planned_steps
    from coretrain.session import session_plugins

    loaded = load(config, overrides)
    run = build_run(loaded.config, session_plugins(loaded), write_config=False)
    planned_steps(run)
    return run


def load_plugins(
    config: str | Path | Mapping[str, Any] | LoadedConfig, overrides: Overrides = (), autoload: bool | None = None
) -> Plugins:
    """The plugins ``config`` (or what :func:`load` returned) enables, configured and registered,
    without a run (a command that asks them something: ``checkpoint export`` asks the format
    plugins); ``autoload``: whether the on-by-default plugins load (None: unless the environment
    says not)."""
    loaded = config if isinstance(config, LoadedConfig) else load(config, overrides)
    return pluginmanager.load_plugins(loaded.config, loaded.locations, autoload=autoload)


@contextlib.contextmanager
def _console_logging(level_name: str) -> Iterator[None]:
    """The run's messages on the console at ``run.log_level`` — through the caller's logging
    when it has set some up, else through a handler of our own for the run's length."""
    logger = logging.getLogger("coretrain")
    previous_level = logger.level
    logger.setLevel(getattr(logging, level_name.upper()))
    handler = None
    if not logging.getLogger().handlers and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("coretrain: %(message)s"))
        logger.addHandler(handler)
    try:
        yield
    finally:
        logger.setLevel(previous_level)
        if handler is not None:
            logger.removeHandler(handler)
