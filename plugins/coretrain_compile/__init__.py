"""``compile``: torch.compile the model once, in place.

Uses ``nn.Module.compile`` so parameter names (and so checkpoints, overrides, exports) stay
the same. It runs between numerics plugins (FP8, ``tryfirst``) and parallel wrappers (DDP,
FSDP, ``trylast``). Compilation happens on the first step, which the loop leaves out of
its throughput figures. torch._dynamo is imported only when this plugin is enabled.
"""

from __future__ import annotations

import logging
from typing import Literal

from attrs import define

from coretrain import Run, hookimpl

log = logging.getLogger("coretrain")


@define(kw_only=True)
class Compile:
    """torch.compile the model (in place, names unchanged)."""

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = "default"
    """torch.compile mode."""
    fullgraph: bool = False
    """Fail instead of falling back to eager at graph breaks."""
    dynamic: bool | None = None
    """Dynamic shapes: unset lets torch decide."""
    backend: str = "inductor"
    """torch.compile's backend."""

    @hookimpl
    def configure_model(self, run: Run) -> None:
        for part in run.model_parts or [run.model]:  # a pipeline's stages on this rank: each
            part.compile(mode=self.mode, fullgraph=self.fullgraph, dynamic=self.dynamic, backend=self.backend)
        log.info("compile: model compiled with mode=%s backend=%s (first step compiles)", self.mode, self.backend)
