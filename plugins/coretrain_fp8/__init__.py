"""``fp8``: FP8 training of the model's Linear layers with torchao (``convert_to_float8_training``).

Recipes: ``tensorwise`` (one scale per tensor; the fastest, and the one whose parameters can be
all-gathered in FP8 under FSDP2 — Megatron's fp8_param_gather), ``rowwise`` and
``rowwise_with_gw_hp`` (finer scales, more accurate). Layers whose dimensions are not
multiples of 16 can't use FP8 matmuls and stay in high precision, and so do the layers
matched by ``skip`` (by default the output head, as torchtitan and Megatron keep the first
and last layers in higher precision). Without FP8 tensor cores (CPU, GPUs before SM 8.9)
torchao emulates the FP8 numerics in high precision: no speed-up, same rounding — what CI
tests — and the plugin says so once. With ``fp8_all_gather`` the scales for the next
all-gather are precomputed after each optimizer step, as torchao requires.
"""

from __future__ import annotations

import logging
from fnmatch import fnmatchcase
from typing import Any, Literal

from attrs import define, field

from coretrain import Run, hookimpl

log = logging.getLogger("coretrain")


@define(kw_only=True)
class FP8:
    """FP8 Linear layers via torchao (emulated where the hardware has no FP8)."""

    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    """torchao float8 recipe."""
    skip: list[str] = field(factory=lambda: ["lm_head", "output", "head"])
    """fnmatch patterns of Linear module names kept in high precision (matched against the full
    name and its last part, so "lm_head" also keeps a wrapped model's hf.lm_head)."""
    fp8_all_gather: bool = False
    """With FSDP2 and the tensorwise recipe: all-gather parameters in FP8."""
    emulate: bool | None = None
    """Force emulation on or off; unset = emulate unless the GPU has FP8 tensor cores (SM 8.9+)."""
    converted: list[str] = field(factory=list, init=False)

    def keep(self, module: Any, name: str) -> bool:
        import torch

        return (
            isinstance(module, torch.nn.Linear)
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
            and not any(fnmatchcase(name, p) or fnmatchcase(name.rsplit(".", 1)[-1], p) for p in self.skip)
        )

    @hookimpl(tryfirst=True)
    def configure_model(self, run: Run) -> None:
        import dataclasses

        import torch

        from coretrain import UserError, require

        float8 = require("torchao.float8", needed_by="plugins.fp8", extra="fp8")
        Float8LinearConfig, convert_to_float8_training = float8.Float8LinearConfig, float8.convert_to_float8_training
        if self.fp8_all_gather and self.recipe != "tensorwise":
            raise UserError("plugins.fp8.fp8_all_gather: only the tensorwise recipe supports it")
        hardware = run.device.type == "cuda" and torch.cuda.get_device_capability(run.device) >= (8, 9)
        emulate = (not hardware) if self.emulate is None else self.emulate
        if emulate and run.dist.is_main:
            log.info("fp8: no FP8 tensor cores here (%s); torchao emulates FP8 numerics, no speed-up", run.device.type)
        if self.recipe == "tensorwise":
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=self.fp8_all_gather, emulate=emulate)
        else:
            config = dataclasses.replace(Float8LinearConfig.from_recipe_name(self.recipe), emulate=emulate)
        self.converted = [name for name, module in run.model.named_modules() if self.keep(module, name)]
        convert_to_float8_training(run.model, config=config, module_filter_fn=self.keep)
        if run.dist.is_main:
            log.info("fp8: %s recipe on %d Linear layers", self.recipe, len(self.converted))

    @hookimpl
    def post_step(self, run: Run) -> None:
        if self.fp8_all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(run.model)
