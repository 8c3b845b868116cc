"""Arguments several commands share: a config file and its ``--set`` overrides (``run``, and
the plugins' ``config``, ``predict``, ``lr-find``, ``sweep``: ``coretrain.add_config_args``)."""

from __future__ import annotations

import argparse


def add_config_args(parser: argparse.ArgumentParser, what: str = "TOML config file") -> None:
    """``CONFIG`` (helped as ``what``) and ``--set KEY.PATH=VALUE`` (repeatable) into ``args.overrides``."""
    parser.add_argument("config", help=what)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a config value (TOML syntax; repeatable), e.g. --set optimizer.lr=3e-4",
    )
