"""``coretrain sweep CONFIG --grid KEY=[a, b] ...``: a grid of runs, one output dir each.

A command plugin (``coretrain.commands``). Every combination of the ``--grid`` values is one
run of the config with those values set, in ``OUTPUT_DIR/sweep/NAME`` (``lr=0.001,micro_batch_size=8``);
every point's config is checked before the first one starts. By default the points run one
after another as ``coretrain run`` processes (``--nproc-per-node N``: each under torchrun);
``--launcher slurm`` writes an array job instead, one task per point. A point that fails does
not stop the others. Re-running the sweep resumes each point from its checkpoints, as
``coretrain run`` does, and a finished point adds nothing. ``coretrain report OUTPUT_DIR/sweep``
compares them.
"""

from __future__ import annotations

import argparse
from typing import Any

import coretrain


def add(commands: Any) -> None:
    """Add ``sweep`` to ``coretrain``'s subcommands."""
    sweep = commands.add_parser("sweep", help="run a grid of configs, one output dir each; compare with report")
    coretrain.add_config_args(sweep)
    sweep.add_argument(
        "--grid",
        action="append",
        default=[],
        required=True,
        metavar="KEY.PATH=[V1,V2]",
        help="a key and its values, as a TOML array (repeatable: every combination runs)",
    )
    sweep.add_argument(
        "--launcher",
        choices=("local", "slurm"),
        default="local",
        help="local: one point after another here (default); slurm: write an array job, one task per point",
    )
    sweep.add_argument("--nproc-per-node", type=int, default=None, metavar="N", help="run each point on N ranks")
    sweep.add_argument("--index", type=int, default=None, metavar="I", help="run only point I (an array task)")
    sweep.add_argument("--dry-run", action="store_true", help="list the points and check their configs; run nothing")
    sweep.add_argument(
        "--max-points", type=int, default=1000, metavar="N", help="refuse a grid of more points (default 1000)"
    )
    sweep.set_defaults(handler=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    from coretrain_sweep.sweep import sweep

    return sweep(args)
