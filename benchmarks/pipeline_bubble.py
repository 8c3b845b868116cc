"""The pipeline bubble of each schedule torch ships, counted from the schedule itself.

    python benchmarks/pipeline_bubble.py [--stages 4 8] [--microbatches 8 16 32]

Each schedule's own action table (``pipeline_order``: which forward, backward or weight-gradient
of which micro-batch each rank runs, in order) is played out with the data dependencies between
stages — a forward needs the previous stage's forward of that micro-batch, a backward the next
stage's backward — and each action's cost in forward units (F 1, a full backward 2, a zero-bubble
schedule's input and weight halves 1 each). The bubble is the share of ranks × time spent idle.
1F1B is torch's interleaved schedule with one stage per rank, GPipe its looped breadth-first one
(their tables are the same as Schedule1F1B's and ScheduleGPipe's). Host arithmetic only: no
process group, no tensors.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

from torch.distributed.pipelining import schedules as S

SCHEDULES = {  # name: (class, stages per rank)
    "GPipe": (S.ScheduleLoopedBFS, 1),
    "1F1B": (S.ScheduleInterleaved1F1B, 1),
    "Interleaved1F1B (2 per rank)": (S.ScheduleInterleaved1F1B, 2),
    "InterleavedZeroBubble (2 per rank)": (S.ScheduleInterleavedZeroBubble, 2),
    "ZBVZeroBubble": (S.ScheduleZBVZeroBubble, 2),
    "DualPipeV": (S.ScheduleDualPipeV, 2),
}
V_SHAPED = (S.ScheduleZBVZeroBubble, S.ScheduleDualPipeV)
COST = {S.FORWARD: 1, S.FULL_BACKWARD: 2, S.BACKWARD_INPUT: 1, S.BACKWARD_WEIGHT: 1}


def actions(kind: Any, ranks: int, per_rank: int, microbatches: int) -> dict[int, list[Any]]:
    """The schedule's compute actions per rank."""
    stages = ranks * per_rank

    def stage_of(local: int) -> int:
        if kind in V_SHAPED:  # rank r holds stages r and 2·ranks − 1 − r
            return 0 if local == 0 else 2 * ranks - 1
        return local * ranks

    fake = [
        SimpleNamespace(num_stages=stages, group_size=ranks, group_rank=0, stage_index=stage_of(i), submod=None)
        for i in range(per_rank)
    ]
    for stage in fake:
        stage.is_first, stage.is_last = stage.stage_index == 0, stage.stage_index == stages - 1
    order = kind(fake, microbatches).pipeline_order  # every rank's table (rank-independent arithmetic)
    return {rank: [a for a in acts if a is not None] for rank, acts in order.items()}


def parts(action: Any) -> list[Any]:
    return list(action.sub_actions) if action.sub_actions else [action]


def needs(part: Any, stages: int) -> list[tuple[Any, int, int]]:
    """The (kind, stage, micro-batch) that must be done before ``part`` starts."""
    kind, stage, mb = part.computation_type, part.stage_index, part.microbatch_index
    if kind == S.FORWARD:
        return [(S.FORWARD, stage - 1, mb)] if stage > 0 else []
    if kind == S.BACKWARD_WEIGHT:
        return [(S.BACKWARD_INPUT, stage, mb)]
    after = [(S.FORWARD, stage, mb)]  # a backward: this stage's forward, the next stage's backward
    return after + ([("backward", stage + 1, mb)] if stage < stages - 1 else [])


def bubble(kind: Any, ranks: int, per_rank: int, microbatches: int) -> float:
    """Idle share of ranks × makespan when the schedule's tables run with their dependencies."""
    order = actions(kind, ranks, per_rank, microbatches)
    stages = ranks * per_rank
    done: dict[tuple[Any, int, int], float] = {}
    clock = dict.fromkeys(order, 0.0)
    position = dict.fromkeys(order, 0)
    busy = 0.0
    while any(position[r] < len(order[r]) for r in order):
        progressed = False
        for rank, acts in order.items():
            if position[rank] == len(acts):
                continue
            pieces = parts(acts[position[rank]])
            wanted = [need for piece in pieces for need in needs(piece, stages)]
            ready = [done.get(need) for need in wanted]
            if any(time is None for time in ready):
                continue
            start = max([clock[rank], *ready])  # type: ignore[list-item]
            cost = sum(COST[piece.computation_type] for piece in pieces)
            clock[rank], busy = start + cost, busy + cost
            for piece in pieces:
                kind_done = piece.computation_type
                done[kind_done, piece.stage_index, piece.microbatch_index] = clock[rank]
                if kind_done in (S.FULL_BACKWARD, S.BACKWARD_INPUT):
                    done["backward", piece.stage_index, piece.microbatch_index] = clock[rank]
            position[rank] += 1
            progressed = True
        if not progressed:
            raise RuntimeError(f"{kind.__name__}: the table deadlocks")
    return 1 - busy / (ranks * max(clock.values()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8], help="ranks in the pipeline")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args()
    header = "| schedule | " + " | ".join(f"{p} ranks, {m} mb" for p in args.stages for m in args.microbatches) + " |"
    print(header)
    print("|" + " --- |" * (header.count("|") - 1))
    for name, (kind, per_rank) in SCHEDULES.items():
        cells = []
        for ranks in args.stages:
            for microbatches in args.microbatches:
                try:
                    cells.append(f"{bubble(kind, ranks, per_rank, microbatches):.1%}")
                except (ValueError, RuntimeError) as exc:  # a schedule's own limits (micro-batches per rank)
                    cells.append(f"n/a: {str(exc).split('(')[0].strip()}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
