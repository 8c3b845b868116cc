"""Arguments several commands share."""

from __future__ import annotations

import argparse


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML config file")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="override a config value (TOML syntax; repeatable), e.g. --set optimizer.lr=3e-4",
    )
