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
scales the scheduled rate. ``decoupled_lr`` / ``decoupled_min_lr`` (Megatron's) are those end
points for the input embedding and the output layer, found as Hugging Face models name them
(``get_input_embeddings()`` / ``get_output_embeddings()``, which the ``gpt`` provider's model and
stages have too); rules still win over them. ``coretrain config show`` prints the resulting
param groups.
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
    decoupled_lr: float | None = field(default=None, validator=non_negative)
    """Megatron's ``--decoupled-lr``: the peak rate of the input embedding and the output layer."""
    decoupled_min_lr: float | None = field(default=None, validator=non_negative)
    """Megatron's ``--decoupled-min-lr``: their rate at the end of the decay (unset: the schedule's)."""

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
        decoupled = self.decoupled_settings()
        ends = embedding_and_output(model) if decoupled else set()
        for name, param in model.named_parameters():
            settings: dict[str, float] = {}
            if self.no_decay_1d and (param.ndim <= 1 or name.endswith(".bias")):
                settings["weight_decay"] = 0.0
            if id(param) in ends:
                settings.update(decoupled)
            for rule in self.rules:
                if fnmatchcase(name, rule.pattern):
                    settings.update(rule.settings())
            if settings:
                overrides[name] = settings
        return overrides

    def __attrs_post_init__(self) -> None:
        if self.decoupled_lr is None and self.decoupled_min_lr is not None:
            from coretrain import FieldValueError

            raise FieldValueError(
                "decoupled_min_lr", "set decoupled_lr too (the peak it decays from), as Megatron does"
            )

    def decoupled_settings(self) -> dict[str, float]:
        if self.decoupled_lr is None:
            return {}
        return {"max_lr": self.decoupled_lr} | (
            {} if self.decoupled_min_lr is None else {"min_lr": self.decoupled_min_lr}
        )


def embedding_and_output(model: Any) -> set[int]:
    """The ids of the input embedding's and the output layer's parameters, from every module's
    ``get_input_embeddings()`` / ``get_output_embeddings()`` (Hugging Face's names; a pipeline
    stage in the middle answers None to both)."""
    from coretrain import UserError

    found: set[int] = set()
    getters = [
        getattr(module, name)
        for module in model.modules()
        for name in ("get_input_embeddings", "get_output_embeddings")
        if callable(getattr(module, name, None))
    ]
    if not getters:
        raise UserError(
            "plugins.optimizer-overrides.decoupled_lr: the model names no input embedding or output layer "
            "(get_input_embeddings() / get_output_embeddings(), as Hugging Face models do); add those methods, "
            "or give their parameters a rule with max_lr / min_lr"
        )
    for getter in getters:
        try:
            layer = getter()
        except (NotImplementedError, AttributeError):  # a Hugging Face base class without the layer
            layer = None
        found |= {id(p) for p in layer.parameters()} if layer is not None else set()
    return found
