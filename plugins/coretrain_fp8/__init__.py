"""``fp8``: FP8 training of the model's Linear layers with torchao (``convert_to_float8_training``).

Recipes: ``tensorwise`` (one scale per tensor; the fastest, and the one whose parameters can be
all-gathered in FP8 under FSDP2 — Megatron's fp8_param_gather), ``rowwise`` and
``rowwise_with_gw_hp`` (finer scales, more accurate). Layers whose dimensions are not
multiples of 16 can't use FP8 matmuls and stay in high precision, and so do the layers
matched by ``skip`` (by default the output head, as torchtitan and Megatron keep the first
and last layers in higher precision). Without FP8 tensor cores (CPU, GPUs before SM 8.9)
torchao emulates the FP8 numerics in high precision: no speed-up, same rounding — what CI
tests — and the plugin says so once. With ``fp8_all_gather`` the scales for the next
all-gather are precomputed after each optimizer step, as torchao requires. ``mxfp8``: torchao's
MXFP8 training (one e8m0 scale per 32 values, Blackwell's MX format; emulated elsewhere).

Megatron-Bridge's mixed-precision recipe names are read too, each as its torchao recipe:
``bf16_with_fp8_current_scaling_mixed`` (and ``fp16_...``) is ``tensorwise``,
``bf16_with_mxfp8_mixed`` is ``mxfp8``; the ``bf16`` or ``fp16`` in the name must be the run's
``run.precision``. Two have no torchao equivalent and are one error naming the nearest:
delayed scaling (an amax history; torchao dropped it) and subchannel scaling (1x128 / 128x128
blocks: torchao's are GPU-only prototypes).
"""

from __future__ import annotations

import logging
from fnmatch import fnmatchcase
from typing import Any

import attrs
from attrs import define, field

from coretrain import FieldValueError, Run, UserError, hookimpl

log = logging.getLogger("coretrain")


TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")
BRIDGE_SCALING = {"fp8_current_scaling": "tensorwise", "mxfp8": "mxfp8"}
"""Megatron-Bridge's ``{bf16,fp16}_with_<scaling>_mixed`` -> the torchao recipe."""
NEAREST = {
    "fp8_delayed_scaling": (
        "fp8_current_scaling",
        "torchao dropped delayed scaling (an amax history); current scaling scales each tensor by its own amax",
    ),
    "fp8_subchannel_scaling": (
        "fp8_current_scaling",
        "torchao's block-scaled (1x128 / 128x128) training is a GPU-only prototype; the finest scales here "
        'are per row: recipe = "rowwise"',
    ),
}


def bridge_parts(name: str) -> tuple[str, str] | None:
    """("bf16" or "fp16", the scaling) of a Megatron-Bridge recipe name, else None."""
    for precision in ("bf16", "fp16"):
        prefix = f"{precision}_with_"
        if name.startswith(prefix) and name.endswith("_mixed"):
            return precision, name[len(prefix) : -len("_mixed")]
    return None


def _recipe(instance: Any, attribute: attrs.Attribute[Any], value: str) -> None:
    parts = bridge_parts(value)
    if value in TORCHAO_RECIPES or (parts is not None and parts[1] in BRIDGE_SCALING):
        return
    if parts is not None and parts[1] in NEAREST:
        nearest, why = NEAREST[parts[1]]
        raise FieldValueError(
            attribute.name,
            f"{value!r} has no torchao equivalent ({why}); the nearest: '{parts[0]}_with_{nearest}_mixed'",
        )
    bridge = [f"bf16_with_{scaling}_mixed" for scaling in BRIDGE_SCALING]
    raise FieldValueError(
        attribute.name,
        f"expected a torchao recipe {list(TORCHAO_RECIPES)} or Megatron-Bridge's {bridge}; got {value!r}",
    )


@define(kw_only=True)
class FP8:
    """FP8 Linear layers via torchao (emulated where the hardware has no FP8)."""

    recipe: str = field(default="tensorwise", validator=_recipe)
    """torchao's float8 recipe (``tensorwise``, ``rowwise``, ``rowwise_with_gw_hp``), ``mxfp8``,
    or a Megatron-Bridge mixed-precision recipe name (``bf16_with_fp8_current_scaling_mixed``,
    ``bf16_with_mxfp8_mixed``, their ``fp16_`` forms)."""
    skip: list[str] = field(factory=lambda: ["lm_head", "output", "head"])
    """fnmatch patterns of Linear module names kept in high precision (matched against the full
    name and its last part, so "lm_head" also keeps a wrapped model's hf.lm_head)."""
    fp8_all_gather: bool = False
    """With FSDP2 and the tensorwise recipe: all-gather parameters in FP8."""
    emulate: bool | None = None
    """Force emulation on or off; unset = emulate unless the GPU has FP8 tensor cores (SM 8.9+)."""
    converted: list[str] = field(factory=list, init=False)

    def torchao_recipe(self) -> str:
        """The torchao recipe this plugin runs (a Megatron-Bridge name read as its own)."""
        parts = bridge_parts(self.recipe)
        return BRIDGE_SCALING[parts[1]] if parts is not None else self.recipe

    def keep(self, module: Any, name: str) -> bool:
        import torch

        multiple = 32 if self.torchao_recipe() == "mxfp8" else 16  # an MX scale covers 32 values
        return (
            isinstance(module, torch.nn.Linear)
            and module.in_features % multiple == 0
            and module.out_features % multiple == 0
            and not any(fnmatchcase(name, p) or fnmatchcase(name.rsplit(".", 1)[-1], p) for p in self.skip)
        )

    @hookimpl(tryfirst=True)
    def configure_model(self, run: Run) -> None:
        import torch

        recipe, parts = self.torchao_recipe(), bridge_parts(self.recipe)
        if parts is not None and run.config.run.precision != parts[0]:
            raise UserError(
                f"plugins.fp8.recipe {self.recipe!r} is Megatron-Bridge's {parts[0]} mixed-precision recipe: "
                f'set run.precision = "{parts[0]}_mixed" (it is "{run.config.run.precision}")'
            )
        if self.fp8_all_gather and recipe != "tensorwise":
            raise UserError("plugins.fp8.fp8_all_gather: only the tensorwise recipe supports it")
        needed = (10, 0) if recipe == "mxfp8" else (8, 9)  # MX on Blackwell, float8 on Ada/Hopper
        hardware = run.device.type == "cuda" and torch.cuda.get_device_capability(run.device) >= needed
        emulate = (not hardware) if self.emulate is None else self.emulate
        if emulate and run.dist.is_main:
            log.info("fp8: no FP8 tensor cores here (%s); torchao emulates FP8 numerics, no speed-up", run.device.type)
        self.converted = [name for name, module in run.model.named_modules() if self.keep(module, name)]
        if recipe == "mxfp8":
            convert_to_mxfp8(run.model, self.keep, emulate)
        else:
            convert_to_float8(run.model, self.keep, recipe, emulate, self.fp8_all_gather)
        if run.dist.is_main:
            log.info("fp8: %s recipe on %d Linear layers", self.recipe, len(self.converted))

    @hookimpl
    def post_step(self, run: Run) -> None:
        if self.fp8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(run.model)


def convert_to_float8(model: Any, keep: Any, recipe: str, emulate: bool, all_gather: bool) -> None:
    """torchao's Float8Linear for the kept layers, by recipe."""
    import dataclasses

    from coretrain import require

    float8 = require("torchao.float8", needed_by="plugins.fp8", extra="fp8")
    if recipe == "tensorwise":
        config = float8.Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=emulate)
    else:
        config = dataclasses.replace(float8.Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    float8.convert_to_float8_training(model, config=config, module_filter_fn=keep)


def convert_to_mxfp8(model: Any, keep: Any, emulate: bool) -> None:
    """torchao's MXFP8 training for the kept layers (its prototype: ``MXFP8TrainingOpConfig``)."""
    from coretrain import require

    quantization = require("torchao.quantization", needed_by="plugins.fp8", extra="fp8")
    try:
        from torchao.prototype.moe_training.config import KernelPreference, MXFP8TrainingOpConfig
    except ImportError as error:
        raise UserError(
            f"plugins.fp8.recipe: MXFP8 needs torchao's MXFP8 training (torchao >= 0.17: "
            f"torchao.prototype.moe_training); this torchao has none ({error}). Upgrade torchao or use 'tensorwise'"
        ) from None
    preference = KernelPreference.EMULATED if emulate else KernelPreference.AUTO
    config = MXFP8TrainingOpConfig(kernel_preference=preference)
    try:
        quantization.quantize_(model, config, filter_fn=lambda module, name: keep(module, name))
    except AssertionError as error:  # torchao's check of the torch it runs on (torch 2.10, 2.11 fail it)
        import torch

        raise UserError(
            f"plugins.fp8.recipe: torchao's MXFP8 training refuses torch {torch.__version__} ({error}); "
            "upgrade torch, or use 'tensorwise'"
        ) from None
    for name, module in model.named_modules():
        if keep(module, name):
            outside_autocast(module)


def outside_autocast(module: Any) -> None:
    """Run the layer with autocast off, its input in its weight's dtype: torchao's MXFP8 matmul
    takes both operands in one dtype, and autocast casts the input but not the wrapped weight."""
    import torch

    forward = module.forward

    def in_weight_dtype(inputs: Any) -> Any:
        with torch.autocast(inputs.device.type, enabled=False):
            return forward(inputs.to(module.weight.dtype))

    module.forward = in_weight_dtype
