"""``memory``: Megatron's empty_unused_memory_level and train_sync_interval.

- ``empty_unused_memory_level``: 0 off; 1 returns cached, unused CUDA memory to the driver
  after each optimizer step; 2 also right after backward. Costs time; helps when another
  process or a fragmentation-prone phase needs the memory.
- ``train_sync_interval``: synchronize the device every N steps so the CPU cannot queue
  up more than N steps of work ahead of the GPU.

On CPU there is nothing to do; the plugin says so once.
"""

from __future__ import annotations

import logging
from typing import Literal

from attrs import define, field

from coretrain import Every, Run, hookimpl, positive

log = logging.getLogger("coretrain")


@define(kw_only=True)
class Memory:
    """Empty the CUDA cache after steps (and backward); sync the device every N steps."""

    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """0 off, 1 after the optimizer step, 2 also after backward."""
    train_sync_interval: int | None = field(default=None, validator=positive)
    """torch.cuda.synchronize() every N steps; unset = never."""
    _cuda: bool = field(default=False, init=False, repr=False)

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        self._cuda = run.device.type == "cuda"
        if not self._cuda and run.dist.is_main:
            log.info("memory: CPU run; empty_unused_memory_level and train_sync_interval have nothing to do")

    @hookimpl
    def before_update(self) -> None:
        if self._cuda and self.empty_unused_memory_level >= 2:
            import torch

            torch.cuda.empty_cache()

    @hookimpl
    def post_step(self, step: int) -> None:
        if not self._cuda:
            return
        import torch

        if self.empty_unused_memory_level >= 1:
            torch.cuda.empty_cache()
        if Every(self.train_sync_interval)(step):
            torch.cuda.synchronize()
