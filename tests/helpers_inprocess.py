"""The core's own tests run through coretrain.testing, the harness plugin authors use.

``config`` names the tiny workload's providers through this module
("helpers_inprocess:make_data") so a test can swap one for a variant; ``train`` is
:func:`coretrain.testing.run_steps`; ``build`` stops before the first step, for tests of
what building a run decides. Evaluation is off unless a test turns it on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from attrs import define

from coretrain.build import build_run
from coretrain.configload import load_config_data
from coretrain.pluginmanager import load_plugins
from coretrain.run import Run
from coretrain.testing import TinyRegression as Regression
from coretrain.testing import run_steps, tiny_config
from coretrain.testing import tiny_data as make_data
from coretrain.testing import tiny_model as make_model

__all__ = ["Regression", "build", "config", "make_data", "make_model", "train"]


@define
class TinyRun:
    """Where a test's run lives and the settings it changes, by table."""

    root: Path
    sections: dict[str, dict[str, Any]]


def config(tmp_path: Any, **sections: dict[str, Any]) -> TinyRun:
    defaults = {
        "model": {"provider": "helpers_inprocess:make_model"},
        "data": {"provider": "helpers_inprocess:make_data"},
        "train": {"eval_iters": 0},
    }
    merged = {name: {**defaults.get(name, {}), **sections.get(name, {})} for name in {*defaults, *sections}}
    return TinyRun(Path(tmp_path), merged)


def build(spec: TinyRun, *extra_plugins: tuple[str, object]) -> Run:
    loaded = load_config_data(tiny_config(spec.root / "out", **spec.sections))
    config = loaded.config
    plugins = load_plugins(config, loaded.locations, autoload=("schedule",))
    for name, plugin in extra_plugins:
        plugins.register(name, plugin)
    plugins.check_pending()
    return build_run(config, plugins)


def train(spec: TinyRun, *extra_plugins: tuple[str, object]) -> tuple[Run, int]:
    result = run_steps(
        spec.root,
        steps=spec.sections["train"].get("train_iters", 10),
        plugins=dict(extra_plugins),
        config=spec.sections,
    )
    return result.run, result.exit_code
