"""In-process runs for the core's own unit tests, on coretrain.testing's tiny workload.

The providers are named through this module ("helpers_inprocess:make_data") so a test can
swap one for a variant; the builder is coretrain.testing's, with evaluation off by default.
"""

from __future__ import annotations

from typing import Any

from coretrain.build import build_run
from coretrain.config import Config
from coretrain.configload import structure
from coretrain.loop import Trainer
from coretrain.pluginmanager import load_plugins
from coretrain.run import Run
from coretrain.testing import TinyRegression as Regression
from coretrain.testing import tiny_config
from coretrain.testing import tiny_data as make_data
from coretrain.testing import tiny_model as make_model

__all__ = ["Regression", "build", "config", "make_data", "make_model", "train"]


def config(tmp_path: Any, **sections: dict[str, Any]) -> Config:
    raw = tiny_config(
        tmp_path / "out",
        model={"provider": "helpers_inprocess:make_model"},
        data={"provider": "helpers_inprocess:make_data"},
        train={"eval_iters": 0},
    )
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    raw["run"].pop("threads")  # the test process's own setting stays
    return structure(raw, Config)


def build(cfg: Config, *extra_plugins: tuple[str, object]) -> Run:
    plugins = load_plugins(cfg)  # real entry points; tests turn autoload off
    for name, plugin in extra_plugins:
        plugins.register(name, plugin)
    plugins.check_pending()
    return build_run(cfg, plugins)


def train(cfg: Config, *extra_plugins: tuple[str, object]) -> tuple[Run, int]:
    run = build(cfg, *extra_plugins)
    code = Trainer(run).train()
    return run, code
