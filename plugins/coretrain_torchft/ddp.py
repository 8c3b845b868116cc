"""``mode = "ddp"``: the gradients averaged over the quorum's groups at every step, with each
group's veto and rerun flags, and the update only when every group of the quorum got through."""

from __future__ import annotations

from typing import Any

import torch

from coretrain import Control, Run


def average_and_commit(manager: Any, run: Run, vetoed: bool, rerun: bool, take: bool) -> tuple[float, float] | None:
    """The gradients averaged over the quorum, with this group's veto and rerun flags: the flags'
    averages, or None when the quorum did not commit. A parameter without a gradient here (no
    sample of this group used it; a step skipped whole) sends zeros, so that every group sends
    the same sizes; it takes the others' share when this group updates (``take``: a step skipped
    whole here has no update to take the averages)."""
    params = [p for p in run.model.parameters() if p.requires_grad]
    grads = [local_part(p.grad) if p.grad is not None else torch.zeros_like(local_part(p)) for p in params]
    dtype = grads[0].dtype if grads else torch.float32
    flags = torch.tensor([vetoed, rerun], dtype=dtype, device=run.device)
    flat = torch.cat([*(g.reshape(-1) for g in grads), flags])
    manager.allreduce(flat).wait()
    if not manager.should_commit():
        return None
    if take:
        _take_averages(params, grads, flat)
    vetoed_by, rerun_by = flat[-2:].tolist()  # (the commit waited on the host already)
    return vetoed_by, rerun_by


def _take_averages(params: list[torch.nn.Parameter], grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Each parameter's gradient becomes its average in ``flat``; one without a gradient gets one."""
    offset = 0
    for p, g in zip(params, grads):
        averaged = flat[offset : offset + g.numel()].view_as(g)
        offset += g.numel()
        if p.grad is None:
            p.grad = torch.zeros_like(p)
            local_part(p.grad).copy_(averaged)
        else:
            g.copy_(averaged)


def agree_on_vetoes(control: Control, vetoed: float, rerun: float) -> None:
    """Another group's veto or rerun of this step, this group's too (averaged flags: > 0 if any)."""
    if rerun > 0 and not control.rerun:
        control.skip_update(control.skip_reason or "another replica group runs this step again", rerun=True)
    elif vetoed > 0 and control.skip_reason is None:
        control.skip_update("another replica group skipped this step's update")


def local_part(grad: torch.Tensor) -> torch.Tensor:
    """A gradient's own part on this rank (a DTensor's local shard: the groups hold the same layout)."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if to_local is not None else grad
