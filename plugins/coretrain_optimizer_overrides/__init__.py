"""``optimizer-overrides``: per-parameter optimizer settings (Megatron's OptimizerConfigOverrideProvider).

On by default: biases and other 1-D parameters (norm gains) get no weight decay, as in
Megatron-Core's default (``name.endswith(".bias") or param.ndim == 1``), nanoGPT and HF
Trainer; ``no_decay_1d = false`` (or ``-p no:optimizer-overrides``) decays every parameter.
Rules match parameter names with fnmatch patterns; later rules win:

    [[plugins.optimizer-overrides.rules]]
    pattern = "wte.*"
    lr_mult = 0.1

    [[plugins.optimizer-overrides.rules]]
    pattern = "blocks.*.attn.*"
    max_lr = 1e-3
    min_lr = 1e-5

``max_lr`` / ``min_lr`` replace the schedule's end points for those parameters; ``lr_mult``
scales the scheduled rate. ``coretrain config show`` prints the resulting param groups.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from attrs import define, field

from coretrain import hookimpl, non_negative


@define(kw_only=True)
class Rule:
    """Optimizer settings for the parameters whose names match ``pattern``."""

    pattern: str
    lr_mult: float | None = field(default=None, validator=non_negative)
    weight_decay: float | None = field(default=None, validator=non_negative)
    max_lr: float | None = field(default=None, validator=non_negative)
    min_lr: float | None = field(default=None, validator=non_negative)

    def settings(self) -> dict[str, float]:
        values = {
            "lr_mult": self.lr_mult,
            "weight_decay": self.weight_decay,
            "max_lr": self.max_lr,
            "min_lr": self.min_lr,
        }
        return {k: v for k, v in values.items() if v is not None}


@define(kw_only=True)
class OptimizerOverrides:
    """Per-parameter lr multipliers, weight decay and schedule end points by name pattern."""

    no_decay_1d: bool = True
    """No weight decay for biases and 1-D parameters (norm gains), Megatron's default."""
    rules: list[Rule] = field(factory=list)
    """[[plugins.optimizer-overrides.rules]] tables: pattern plus any of lr_mult, weight_decay,
    max_lr, min_lr."""

    @hookimpl
    def param_group_overrides(self, model: Any) -> dict[str, dict[str, float]]:
        from coretrain import UserError

        overrides: dict[str, dict[str, float]] = {}
        names = [name for name, _ in model.named_parameters()]
        for rule in self.rules:
            if not any(fnmatchcase(name, rule.pattern) for name in names):
                raise UserError(
                    f"plugins.optimizer-overrides.rules: pattern {rule.pattern!r} matches no "
                    f"parameter; names look like {names[:3]}"
                )
        for name, param in model.named_parameters():
            settings: dict[str, float] = {}
            if self.no_decay_1d and (param.ndim <= 1 or name.endswith(".bias")):
                settings["weight_decay"] = 0.0
            for rule in self.rules:
                if fnmatchcase(name, rule.pattern):
                    settings.update(rule.settings())
            if settings:
                overrides[name] = settings
        return overrides
