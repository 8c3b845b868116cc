"""``weight-hash``: check that data-parallel replicas still hold identical weights.

Every ``interval`` steps each rank hashes its parameters (SHA-256 of their bytes) and the
ranks compare one combined digest; on a mismatch they compare per parameter, rank 0 names
the first parameter that differs and on which ranks, and the run stops with ``exit_code``
and without a checkpoint (the replicas disagree, so there is no single state to save).
DTensor parameters (FSDP2 shards, tensor-parallel splits) are different on each rank by design
and are not compared.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from attrs import define, field

from coretrain import Run, exit_code, hookimpl, positive

log = logging.getLogger("coretrain")


def parameter_digests(model: Any) -> list[tuple[str, str]]:
    import torch

    digests = []
    for name, param in model.named_parameters():
        if hasattr(param, "full_tensor"):  # a shard: differs per rank by design
            continue
        data = param.detach().cpu().contiguous().flatten().view(dtype=torch.uint8)
        digests.append((name, hashlib.sha256(data.numpy().tobytes()).hexdigest()))
    return digests


@define(kw_only=True)
class WeightHash:
    """Every N steps, compare parameter hashes across data-parallel replicas."""

    interval: int = field(default=100, validator=positive)
    """Compare every N steps."""
    exit_code: int = field(default=4, validator=exit_code)
    """Process exit code when replicas differ."""

    @hookimpl
    def post_step(self, run: Run, step: int) -> None:
        if run.dist.world_size == 1 or step % self.interval:
            return
        import torch.distributed as dist

        digests = parameter_digests(run.unwrapped_model)
        combined = hashlib.sha256("".join(d for _, d in digests).encode()).hexdigest()
        everyone: list[Any] = [None] * run.dist.world_size
        dist.all_gather_object(everyone, combined)
        if len(set(everyone)) == 1:
            return
        per_rank: list[Any] = [None] * run.dist.world_size
        dist.all_gather_object(per_rank, digests)
        for index, (name, _) in enumerate(digests):
            values = [rank_digests[index][1] for rank_digests in per_rank]
            if len(set(values)) > 1:
                groups: dict[str, list[int]] = {}
                for rank, value in enumerate(values):
                    groups.setdefault(value, []).append(rank)
                message = (
                    f"weight-hash: step {step}: replicas differ, first at parameter '{name}' "
                    f"(ranks grouped by value: {sorted(groups.values())})"
                )
                if run.dist.is_main:
                    log.error(message)
                run.control.request_stop(message, checkpoint=False, exit_code=self.exit_code)
                return
