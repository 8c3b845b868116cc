"""Plan a sweep (check every point's config, write ``sweep.json``), then run it here or write
the SLURM array job that runs it."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

import coretrain
from coretrain import UserError
from coretrain_sweep.grid import Point, grid_size, parse_grid, points


def sweep(args: argparse.Namespace) -> int:
    grid = parse_grid(args.grid)
    grid_size(grid, args.max_points)  # before any point is made or loaded
    planned = points(grid)
    base = coretrain.load(args.config, args.overrides).config
    root = Path(base.output_dir) / "sweep"
    for point in planned:  # a typo in one point's value fails now, not hours into the sweep
        try:
            coretrain.load(args.config, [*args.overrides, *point.sets])
        except UserError as exc:
            raise UserError(f"sweep point {point.index} ({point.name}): {exc}") from None
    if args.index is not None and not 0 <= args.index < len(planned):
        raise UserError(f"--index {args.index}: the grid has points 0..{len(planned) - 1}")
    array_job = args.launcher == "slurm" and args.index is None
    log_files = sbatch_path(root / "slurm-%A_%a.out", literal=len(str(root))) if array_job else ""
    root.mkdir(parents=True, exist_ok=True)
    write_plan(root, args, grid, planned)
    if args.dry_run:
        for point in planned:
            print(f"{point.index:>3}  {root / point.name}  {' '.join(point.sets)}")
        return 0
    if array_job:
        script = write_sbatch(root, args, len(planned), log_files)
        print(f"sweep: {len(planned)} points; wrote {script}\nsubmit it with: sbatch {script}")
        return 0
    chosen = planned if args.index is None else [planned[args.index]]
    codes = {point.name: run_point(args, root, point) for point in chosen}
    failed = [name for name, code in codes.items() if code != 0]
    width = max(len(name) for name in codes)
    print("sweep:" + "".join(f"\n  {name:<{width}}  exit {code}" for name, code in codes.items()))
    print(f"compare them: coretrain report {root}")
    return 1 if failed else 0


def command(args: argparse.Namespace, root: Path, point: Point) -> list[str]:
    """``coretrain run`` of one point, with its values and its own output dir."""
    ranks = ["--nproc-per-node", str(args.nproc_per_node)] if args.nproc_per_node else []
    sets = [*args.overrides, *point.sets, f"run.output_dir={json.dumps(str(root / point.name))}"]
    return [sys.executable, "-m", "coretrain", "run", args.config, *ranks, *(x for s in sets for x in ("--set", s))]


def run_point(args: argparse.Namespace, root: Path, point: Point) -> int:
    print(f"sweep: point {point.index} ({point.name})", flush=True)
    return subprocess.run(command(args, root, point), check=False).returncode


def write_plan(root: Path, args: argparse.Namespace, grid: dict[str, list[object]], planned: list[Point]) -> None:
    """``sweep.json``: what was swept and where each point's run lives."""
    plan = {
        "config": str(Path(args.config).resolve()),
        "overrides": args.overrides,
        "grid": grid,
        "points": [
            {"index": p.index, "name": p.name, "values": p.values, "output_dir": str(root / p.name)} for p in planned
        ],
    }
    (root / "sweep.json").write_text(json.dumps(plan, indent=1) + "\n", encoding="utf-8")


def sbatch_path(path: Path, literal: int) -> str:
    """``path`` as an ``#SBATCH`` line takes it: in double quotes (sbatch reads quoted arguments),
    its first ``literal`` characters' ``%`` doubled (the rest are SLURM's patterns). A newline,
    another control character or a double quote cannot be written there: refused, since the
    script would run what follows a newline as a command."""
    text = str(path)
    if any(ord(c) < 32 or c in '"\x7f' for c in text):
        raise UserError(
            f"run.output_dir {str(path.parent.parent)!r}: a newline, control character or double quote cannot "
            "go into the array job's #SBATCH lines; choose a directory without them"
        )
    return '"' + text[:literal].replace("%", "%%") + text[literal:] + '"'


def write_sbatch(root: Path, args: argparse.Namespace, count: int, log_files: str) -> Path:
    """An array job: task I runs point I (``coretrain sweep ... --index I``), requeued when
    preempted, as examples/slurm.sbatch does for one run."""
    again = ["coretrain", "sweep", str(Path(args.config).resolve())]
    again += [x for g in args.grid for x in ("--grid", g)] + [x for s in args.overrides for x in ("--set", s)]
    if args.nproc_per_node:
        again += ["--nproc-per-node", str(args.nproc_per_node)]
    script = root / "sweep.sbatch"
    script.write_text(
        f"""#!/bin/bash
# coretrain sweep: {count} points, one array task each (written by `coretrain sweep --launcher slurm`).
#SBATCH --job-name=coretrain-sweep
#SBATCH --array=0-{count - 1}
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --signal=B:USR1@90
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output={log_files}

set -u
task="${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}"
requeue() {{ kill -TERM "$pid" 2>/dev/null; wait "$pid"; scontrol requeue "$task"; exit 0; }}
trap requeue USR1 TERM
{shlex.join(again)} --index "$SLURM_ARRAY_TASK_ID" &
pid=$!
wait "$pid"
""",
        encoding="utf-8",
    )
    return script
