"""``coretrain report RUN_DIR ...``: plots and a summary of one run, or a comparison of several.

A command plugin: registered in the ``coretrain.commands`` entry-point group, as any
package's command is. It reads the file the ``metrics-file`` plugin writes, so it ships
beside it; the core reads no plugin's format.
"""

from __future__ import annotations

import argparse
from typing import Any


def add(commands: Any) -> None:
    """Add this module's command(s) to ``coretrain``'s subcommands."""
    report = commands.add_parser(
        "report",
        help="plot a run's metrics (PNG files) and print a summary; several runs: overlaid, with a comparison table",
    )
    report.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help="a run's output dir (holds metrics.jsonl), or a directory of runs (a sweep's)",
    )
    report.add_argument(
        "--metrics", default=None, metavar="FILE", help="read this file instead of RUN_DIR/metrics.jsonl"
    )
    report.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where the PNGs go (default: RUN_DIR/report; several runs: FIRST_RUN_DIR/report/compare)",
    )
    report.set_defaults(handler=cmd_report)


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coretrain_report.report import report

    return report(
        [Path(d) for d in args.run_dirs],
        Path(args.metrics) if args.metrics else None,
        Path(args.out) if args.out else None,
    )
