"""``coretrain lr-find CONFIG``: the learning-rate range test, as Lightning's tuner runs it.

A command plugin (``coretrain.commands``). It trains the config's model on its data for up to
``--steps`` steps at a learning rate growing exponentially from ``--min-lr`` to ``--max-lr``,
in ``OUTPUT_DIR/lr_find/`` with checkpoints off, so the run's own checkpoints and metrics are
never touched; then it writes ``lr_find.jsonl`` and, with matplotlib, ``lr_find.png`` (loss
against lr, the suggestions marked) and prints two suggestions for ``optimizer.lr``.
"""

from __future__ import annotations

import argparse
from typing import Any

import coretrain


def add(commands: Any) -> None:
    """Add ``lr-find`` to ``coretrain``'s subcommands."""
    finder = commands.add_parser(
        "lr-find", help="sweep the learning rate over a short run, plot loss against it, suggest a value"
    )
    coretrain.add_config_args(finder, "TOML config file (the run to tune)")
    finder.add_argument("--min-lr", type=float, default=1e-8, help="the first step's lr (default 1e-8, Lightning's)")
    finder.add_argument("--max-lr", type=float, default=1.0, help="the last step's lr (default 1)")
    finder.add_argument("--steps", type=int, default=100, help="steps of the sweep (default 100)")
    finder.add_argument(
        "--diverge", type=float, default=4.0, help="stop once the smoothed loss exceeds this × its lowest (default 4)"
    )
    finder.add_argument(
        "--rule",
        choices=["steepest", "lightning", "minimum/10"],
        default="steepest",
        help="which suggestion to set: the steepest fall against log(lr) (default), against lr (Lightning's), "
        "or the lowest loss's lr / 10 (fastai's); all three are printed",
    )
    finder.set_defaults(handler=cmd_lr_find)


def cmd_lr_find(args: argparse.Namespace) -> int:
    from coretrain_lr_find.command import lr_find

    return lr_find(args.config, args.overrides, args.min_lr, args.max_lr, args.steps, args.diverge, args.rule)
