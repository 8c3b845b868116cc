"""Test a plugin the way coretrain runs it — what ``pytester`` is to pytest plugins.

A tiny model and dataset, a function that runs N steps in this process with your plugin
instance (or its TOML table) and returns the metrics and every hook call, helpers to stop and
resume, to send a real signal mid-run, and to run real ranks under torchrun::

    from coretrain.testing import run_steps

    def test_my_plugin_logs(tmp_path):
        result = run_steps(tmp_path, steps=6, plugins={"mine": MyPlugin(every=2)})
        assert result.exit_code == 0
        assert [m["step"] for m in result.metrics] == [2, 4, 6]
        assert result.hooks("on_log") == [2, 4, 6]

The run is a real one: the config goes through the same loader and validators as a TOML
file, plugins are registered and checked as installed ones are, and the loop, checkpoints
and resume are the production code. Installed plugins stay off unless asked for
(``tables={"name": {...}}``) so a test sees only what it enables.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from coretrain.configload import deep_merge, load_config, toml_text
from coretrain.markers import hookimpl
from coretrain.run import DatasetContext, Datasets, Run

TINY_MODEL = "coretrain.testing:tiny_model"
BEHAVIOUR = ("evaluation", "optimizer-overrides", "schedule", "hf-datasets", "streams", "resume-checks")
"""The on-by-default plugins that change what a run computes or accepts (the others watch or report)."""
TINY_DATA = "coretrain.testing:tiny_data"
COUNTED_OTHERWISE = {"train_samples", "train_epochs"}
"""The train keys that say the run's length instead of ``train_iters``."""


# --------------------------------------------------------------------------- a tiny workload


class TinyRegression(torch.nn.Module):
    """A 2-layer MLP on 4 features; ``model(x, y)`` returns its MSE loss (what Lightning's
    BoringModel is to callbacks: small, deterministic, learns)."""

    def __init__(self, width: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Dropout(dropout), torch.nn.Linear(width, 1)
        )

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.net(x), y)


def tiny_model(width: int = 16, dropout: float = 0.0) -> torch.nn.Module:
    """The model provider ``"coretrain.testing:tiny_model"``."""
    return TinyRegression(width, dropout)


def tiny_data(context: DatasetContext, samples: int = 256, valid: bool = True, dead_inputs: int = 0) -> Datasets:
    """The data provider ``"coretrain.testing:tiny_data"``: y = 0.5·sum(x), fixed seed.

    ``dead_inputs``: that many input features are always 0 (their first-layer weights get no gradient).
    """
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 4, generator=g)
    x[:, :dead_inputs] = 0.0
    y = 0.5 * x.sum(dim=1, keepdim=True)
    pairs = torch.utils.data.TensorDataset
    return Datasets(train=pairs(x, y), valid=pairs(x[:64], y[:64]) if valid else None)


def tiny_config(output_dir: str | Path, **sections: Mapping[str, Any]) -> dict[str, Any]:
    """A complete config as a TOML-shaped dict: the tiny workload, 10 steps, a log every 2, a
    validation of 2 batches after training.

    ``sections`` are merged in by table, e.g. ``train={"train_iters": 4}``,
    ``plugins={"guards": {"action": "stop"}}``.
    """
    base: dict[str, Any] = {
        "run": {"output_dir": str(output_dir), "seed": 7, "threads": 1},
        "model": {"provider": TINY_MODEL},
        "data": {"provider": TINY_DATA},
        "train": {"micro_batch_size": 8, "train_iters": 10, "log_interval": 2, "eval_iters": 2},
        "optimizer": {"lr": 0.01},
    }
    if COUNTED_OTHERWISE & set(sections.get("train", {})):  # counted in samples or epochs: no step count
        del base["train"]["train_iters"]
    return deep_merge(base, {name: dict(values) for name, values in sections.items()})


def write_config(path: Path, config: Mapping[str, Any]) -> Path:
    """Write ``config`` as TOML (what a user would hand ``coretrain run``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(toml_text(config), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- in-process runs


@attrs.frozen
class HookCall:
    """One call of a hook, as the plugins received it."""

    hook: str
    step: int
    """The ``step`` argument, or the run's step when the hook has none."""
    plugins: tuple[str, ...]
    """The plugins whose implementations ran (wrappers included), outermost last."""
    kwargs: Mapping[str, Any] = attrs.field(repr=False)


@attrs.define
class Result:
    """What one in-process run did."""

    exit_code: int
    run: Run
    calls: list[HookCall]
    output_dir: Path

    @property
    def metrics(self) -> list[dict[str, float]]:
        """Each ``on_log``'s metrics (with ``step``), as the last plugin saw them."""
        return [{"step": call.step, **call.kwargs["metrics"]} for call in self.calls if call.hook == "on_log"]

    @property
    def evals(self) -> list[dict[str, float]]:
        """Each ``on_eval``'s metrics (with ``step``)."""
        return [{"step": call.step, **call.kwargs["metrics"]} for call in self.calls if call.hook == "on_eval"]

    def hooks(self, name: str | None = None) -> list[Any]:
        """The steps at which hook ``name`` was called; without a name, every hook called, in order."""
        if name is None:
            return [call.hook for call in self.calls]
        return [call.step for call in self.calls if call.hook == name]


class MetricsObserver:
    """Implements on_log and on_eval, so a run reports its metrics even when the plugin under
    test does not implement them (the loop calls no hook nobody implements)."""

    @hookimpl(trylast=True)
    def on_log(self) -> None:
        pass

    on_eval = on_log


class HookRecorder:
    """Records every hook call through pluggy's own call monitoring (nothing is wrapped)."""

    def __init__(self) -> None:
        self.calls: list[HookCall] = []

    def attach(self, plugins: Any) -> Any:
        """Record each call of ``plugins``' hooks from now on (a dict argument copied as it was
        then); returns the function that stops it."""

        def after(outcome: Any, hook_name: str, impls: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
            run = kwargs.get("run")
            step = kwargs.get("step", run.state.step if isinstance(run, Run) else 0)
            recorded = {name: dict(value) if isinstance(value, dict) else value for name, value in kwargs.items()}
            names = tuple(impl.plugin_name for impl in impls)
            self.calls.append(HookCall(hook=hook_name, step=int(step), plugins=names, kwargs=recorded))

        return plugins.manager.add_hookcall_monitoring(lambda *_: None, after)


def run_steps(
    tmp_path: str | Path,
    steps: int = 10,
    *,
    plugins: Mapping[str, object] | None = None,
    tables: Mapping[str, Mapping[str, Any]] | None = None,
    config: Mapping[str, Mapping[str, Any]] | None = None,
    autoload: bool | Collection[str] = BEHAVIOUR,
) -> Result:
    """Train ``steps`` steps of the tiny workload (or what ``config`` names) in this process.

    ``plugins``: instances to register under a name (your plugin, configured in Python);
    ``tables``: installed plugins to enable with these ``[plugins.NAME]`` tables (your plugin as
    a user turns it on); ``config``: more settings by table, e.g. ``{"train": {"log_interval": 5}}``;
    ``autoload``: the on-by-default plugins to keep on (all: True; by default those that change
    what a real run computes: ``evaluation``, so it reports ``valid/*``, ``optimizer-overrides``,
    so biases and norms get no weight decay, ``schedule``, the learning-rate schedule,
    ``hf-datasets`` and ``streams``, which read those splits, and ``resume-checks``).
    A second call with the same ``tmp_path`` resumes from the newest checkpoint, as a restarted
    job does. Errors are raised as the CLI would report them (:class:`coretrain.UserError` for
    a mistake in the config, ``PluginError`` naming a failing plugin).
    """
    from coretrain.session import run_session, session_plugins

    loaded = load_config(_write_steps_config(Path(tmp_path), steps, tables or {}, config or {}))
    extra = {**(plugins or {}), "coretrain-testing-metrics": MetricsObserver()}
    manager = session_plugins(loaded, extra, autoload=autoload)
    recorder = HookRecorder()
    undo = recorder.attach(manager)
    try:
        code, run = run_session(loaded, manager)
    finally:
        undo()
    return Result(exit_code=code, run=run, calls=recorder.calls, output_dir=Path(loaded.config.output_dir))


def _write_steps_config(
    root: Path, steps: int, tables: Mapping[str, Mapping[str, Any]], config: Mapping[str, Mapping[str, Any]]
) -> Path:
    """The run's config.toml in ``root``: the tiny workload for ``steps`` steps, under ``config``'s
    tables and with ``tables`` as plugins' tables, written as a user's file is."""
    sections: dict[str, Any] = {name: dict(values) for name, values in config.items()}
    train = sections.get("train", {})  # steps, unless it counts in samples or epochs or names its own
    sections["train"] = train if COUNTED_OTHERWISE & set(train) else {"train_iters": steps, **train}
    if tables:
        sections["plugins"] = {**sections.get("plugins", {}), **{name: dict(t) for name, t in tables.items()}}
    return write_config(root / "config.toml", tiny_config(root / "out", **sections))


def stop_and_resume(tmp_path: str | Path, stop_at: int, steps: int = 10, **options: Any) -> tuple[Result, Result]:
    """Train until ``stop_at`` (an exit condition: checkpoint, exit 0), then resume to ``steps``
    in a new run object, as a requeued job does; ``options`` as for :func:`run_steps` (plugin
    instances are reused: pass factories' results per call yourself when state must not leak)."""
    config = {name: dict(values) for name, values in options.pop("config", {}).items()}
    first_config = {**config, "train": {**config.get("train", {}), "exit_interval": stop_at}}
    first = run_steps(tmp_path, steps, config=first_config, **options)
    second = run_steps(tmp_path, steps, config=config, **options)
    return first, second


@attrs.define
class SignalAt:
    """A plugin that sends this process a real signal after step ``step`` — to test what your
    plugin does when a job is preempted (``on_signal``, the checkpoint, exit 128+signum)."""

    step: int
    signum: int = signal.SIGTERM

    @hookimpl
    def post_step(self, step: int) -> None:
        if step == self.step:
            os.kill(os.getpid(), self.signum)


def run_until_signal(tmp_path: str | Path, step: int, signum: int = signal.SIGTERM, **options: Any) -> Result:
    """:func:`run_steps` with a real ``signum`` delivered to this process after ``step``."""
    plugins = {**options.pop("plugins", {}), "coretrain-testing-signal": SignalAt(step, signum)}
    return run_steps(tmp_path, plugins=plugins, **options)


# --------------------------------------------------------------------------- real ranks


def run_ranks(
    tmp_path: str | Path,
    nproc: int = 2,
    steps: int = 10,
    *,
    config: Mapping[str, Mapping[str, Any]] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node NPROC -m coretrain run`` on the tiny workload, gloo on CPU,
    one torch thread per rank. Plugins must be installed (entry points) to run in the ranks;
    enable them through ``config={"plugins": {...}}``. Returns the finished process (stdout and
    stderr captured); the run's files are under ``tmp_path / "out"``."""
    root, config = Path(tmp_path), dict(config or {})
    path = _write_steps_config(
        root, steps, {}, {**config, "distributed": {"backend": "gloo", **config.get("distributed", {})}}
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += ["-m", "coretrain", "run", str(path)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(command, cwd=root, env=full_env, capture_output=True, text=True, timeout=timeout)
