"""``coretrain predict CONFIG``: the model's outputs for every sample of a split, written once.

A command plugin (``coretrain.commands``). It builds the run's model with the weights of one
of its checkpoints (``--checkpoint``: the newest, ``best``, a step, a path, or ``none`` for
the provider's own weights), in ``OUTPUT_DIR/predict/`` so the run's own files stay as they
are, and on every rank predicts its share of the samples in batches; rank 0 gathers them and
writes one file. What a batch's records are is the ``predict_step`` hook's answer (the ``hf``
provider generates text for ``--data prompts.jsonl``; the built-in answer writes the model's
per-sample outputs), and writing them the ``write_predictions`` hook's (``.jsonl`` and
``.parquet`` built in).
"""

from __future__ import annotations

import argparse
from typing import Any

import coretrain


def add(commands: Any) -> None:
    """Add ``predict`` to ``coretrain``'s subcommands."""
    predict = commands.add_parser("predict", help="the model's outputs per sample of a split, or for prompts")
    coretrain.add_config_args(predict, "TOML config file (the run whose model predicts)")
    predict.add_argument(
        "--checkpoint",
        default=None,
        metavar="best|STEP|PATH|none",
        help="whose weights: the run's newest checkpoint (default), its best, a step, a checkpoint "
        "directory, or none (the model as its provider builds it)",
    )
    source = predict.add_mutually_exclusive_group()
    source.add_argument("--split", default=None, help="valid, test (default) or train, or valid/NAME of a named set")
    source.add_argument(
        "--data", default=None, metavar="FILE", help="prompts: a .jsonl/.parquet of 'prompt' texts or 'messages' chats"
    )
    predict.add_argument("--out", required=True, metavar="FILE", help="predictions.jsonl or .parquet")
    predict.add_argument("--batch-size", type=int, default=None, help="samples per batch and rank (default: eval's)")
    generate = predict.add_argument_group("generation (a causal LM given --data)")
    generate.add_argument("--max-new-tokens", type=int, default=32, help="tokens generated per prompt (default 32)")
    generate.add_argument(
        "--temperature", type=float, default=None, help="sample at this temperature (unset or 0: greedy)"
    )
    generate.add_argument("--top-p", type=float, default=None, help="sample from the top-p nucleus (unset: all)")
    generate.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    predict.set_defaults(handler=cmd_predict)


def cmd_predict(args: argparse.Namespace) -> int:
    from coretrain_predict.command import predict

    return predict(args)
