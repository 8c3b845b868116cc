"""Optimizer by name or import path, one param group per distinct set of per-parameter overrides."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from coretrain.config import OptimizerConfig
from coretrain.usercode import check_options, import_callable

OPTIMIZERS = {name.lower(): getattr(torch.optim, name) for name in ("AdamW", "Adam", "SGD", "Adafactor")}


def build_optimizer(
    cfg: OptimizerConfig, model: torch.nn.Module, overrides: Mapping[str, Mapping[str, float]]
) -> torch.optim.Optimizer:
    """One param group per distinct override set; ``lr_mult`` is kept on the group for the schedule."""
    groups: dict[tuple[tuple[str, float], ...], dict[str, Any]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        override = dict(overrides.get(name, {}))
        key = tuple(sorted(override.items()))
        group = groups.setdefault(key, {"params": [], "param_names": [], "lr_mult": 1.0, **override})
        group["params"].append(param)
        # saved with the state, as the checkpoint names the weights (without DDP's "module."): it
        # loads by name into any part of the model
        group["param_names"].append(name.removeprefix("module." if hasattr(model, "module") else ""))
    kind = OPTIMIZERS.get(cfg.name) or import_callable(cfg.name, "optimizer.name")
    takes_decay = "weight_decay" in inspect.signature(kind).parameters  # a class by import path may not
    decay = {"weight_decay": cfg.weight_decay} if takes_decay else {}
    settings = {"lr": cfg.lr, **decay, **_options(cfg), **cfg.options}
    check_options(kind, settings, "optimizer.options", ("params",))
    optimizer: torch.optim.Optimizer = kind(list(groups.values()), **settings)
    return optimizer


def _options(cfg: OptimizerConfig) -> dict[str, Any]:
    """The optimizer's own settings: SGD's momentum, Adam's betas and eps; Adafactor keeps torch's;
    a class by import path has its ``options`` alone."""
    own: dict[str, dict[str, Any]] = {"sgd": {"momentum": cfg.momentum}, "adafactor": {}}
    return own.get(cfg.name, {"betas": cfg.betas, "eps": cfg.eps}) if cfg.name in OPTIMIZERS else {}
