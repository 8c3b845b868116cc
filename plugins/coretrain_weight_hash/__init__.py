"""``weight-hash``: check that data-parallel replicas still hold identical weights.

Every ``interval`` steps each rank hashes its parameters (SHA-256 of their bytes) and the
ranks compare one combined digest; on a mismatch they compare per parameter, rank 0 names
the first parameter that differs and on which ranks, and the run stops with ``exit_code``
and without a checkpoint (the replicas disagree, so there is no single state to save).

A DTensor parameter (FSDP2, tensor parallelism) is compared only among the ranks that hold the
same part of it — those whose mesh coordinates differ only along dimensions it is replicated
over (a norm replicated inside a tensor-parallel group); a part held by one rank alone has
nothing to be compared with.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from attrs import define, field

from coretrain import Every, Run, exit_code, hookimpl, positive

log = logging.getLogger("coretrain")

Part = tuple[Any, ...]
Digest = tuple[str, Part, str]
"""(parameter name, which part of it this rank holds, SHA-256 of that part)."""


def part_held(param: Any) -> Part:
    """Which part of ``param`` this rank holds: the mesh, and this rank's coordinates along the
    dimensions the parameter is split over (() for a plain tensor: every rank holds all of it).
    Ranks with equal parts must hold equal bytes."""
    placements = getattr(param, "placements", None)
    if placements is None:
        return ()
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate() or []
    split = tuple(
        (dim, c) for dim, (c, placement) in enumerate(zip(coordinate, placements)) if not placement.is_replicate()
    )
    return (mesh.mesh_dim_names, tuple(mesh.shape), split)


def parameter_digests(model: Any) -> list[Digest]:
    import torch

    digests = []
    for name, param in model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        data = local.detach().cpu().contiguous().flatten().view(dtype=torch.uint8)
        digests.append((name, part_held(param), hashlib.sha256(data.numpy().tobytes()).hexdigest()))
    return digests


def first_difference(per_rank: list[list[Digest]]) -> tuple[str, list[list[int]]] | None:
    """The first parameter whose holders of one part disagree, with those ranks grouped by value."""
    for index, (name, _, _) in enumerate(per_rank[0]):
        holders: dict[tuple[int, ...], dict[str, list[int]]] = {}
        for rank, digests in enumerate(per_rank):
            _, part, digest = digests[index]
            holders.setdefault(part, {}).setdefault(digest, []).append(rank)
        for by_value in holders.values():
            if len(by_value) > 1:
                return name, sorted(by_value.values())
    return None


@define(kw_only=True)
class WeightHash:
    """Every N steps, compare parameter hashes across data-parallel replicas."""

    interval: int = field(default=100, validator=positive)
    """Compare every N steps."""
    exit_code: int = field(default=4, validator=exit_code)
    """Process exit code when replicas differ."""

    @hookimpl
    def post_step(self, run: Run, step: int) -> None:
        if run.dist.world_size == 1 or not Every(self.interval)(step):
            return
        import torch.distributed as dist

        digests = parameter_digests(run.unwrapped_model)
        by_part: dict[Part, str] = {}  # one combined digest per kind of part: a few entries
        for _, part, digest in digests:
            by_part[part] = hashlib.sha256((by_part.get(part, "") + digest).encode()).hexdigest()
        everyone: list[Any] = [None] * run.dist.world_size
        dist.all_gather_object(everyone, by_part)
        seen: dict[Part, set[str]] = {}
        for rank_parts in everyone:
            for part, combined in rank_parts.items():
                seen.setdefault(part, set()).add(combined)
        if all(len(values) == 1 for values in seen.values()):
            return
        per_rank: list[Any] = [None] * run.dist.world_size
        dist.all_gather_object(per_rank, digests)
        found = first_difference(per_rank)
        if found is None:
            return
        name, groups = found
        message = (
            f"weight-hash: step {step}: replicas differ, first at parameter '{name}' (ranks grouped by value: {groups})"
        )
        if run.dist.is_main:
            log.error(message)
        run.control.request_stop(message, checkpoint=False, exit_code=self.exit_code)
