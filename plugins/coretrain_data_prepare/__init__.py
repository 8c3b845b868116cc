"""``coretrain data prepare``: text (jsonl, parquet, plain) + a local Hugging Face tokenizer →
Megatron's ``.bin/.idx`` pairs, as Megatron-LM's ``tools/preprocess_data.py`` writes them.

A command module only (``coretrain.commands`` entry point): it imports nothing heavy until the
command runs, so ``coretrain --help`` stays fast.
"""

from __future__ import annotations

import argparse
from typing import Any


def add(commands: Any) -> None:
    """Add ``data prepare`` to ``coretrain``'s subcommands."""
    data = commands.add_parser("data", help="prepare training data (Megatron's .bin/.idx)")
    actions = data.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    prepare = actions.add_parser(
        "prepare",
        help="tokenize jsonl/parquet/text files into PREFIX_KEY_document.bin/.idx (preprocess_data.py's output)",
    )
    prepare.add_argument("inputs", nargs="+", metavar="INPUT", help=".jsonl/.json, .parquet or text files")
    which = prepare.add_mutually_exclusive_group(required=True)
    which.add_argument("--tokenizer", metavar="DIR", help="a local Hugging Face tokenizer directory")
    which.add_argument(
        "--config",
        metavar="CONFIG",
        help="the run's config: its [tokenizer] (path, trust_remote_code), as the run's",
    )
    prepare.add_argument(
        "--output-prefix", required=True, metavar="PREFIX", help="writes PREFIX_KEY_document.bin/.idx per key"
    )
    prepare.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY", help="fields to tokenize")
    prepare.add_argument("--append-eod", action="store_true", help="end every document with the tokenizer's EOS")
    prepare.add_argument(
        "--tokenizer-hf-no-include-special-tokens",
        action="store_true",
        help="Megatron's flag: encode without the special tokens the tokenizer adds (a BOS); with --config, "
        "data.options.include_special_tokens = false of the indexed provider says it too",
    )
    prepare.add_argument(
        "--workers", type=int, default=1, metavar="N", help="tokenizing processes (default 1: this one)"
    )
    prepare.add_argument(
        "--input-format",
        choices=["auto", "jsonl", "parquet", "text"],
        default="auto",
        help="auto: by extension (.jsonl/.json, .parquet, anything else is text)",
    )
    prepare.add_argument(
        "--sample-by",
        choices=["line", "paragraph", "document"],
        default="line",
        help="text files: one document per line (as datasets' text loader), blank-line paragraph, or file",
    )
    prepare.add_argument(
        "--log-interval", type=int, default=10000, metavar="N", help="without a terminal: a line every N documents"
    )
    prepare.set_defaults(handler=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    from coretrain_data_prepare.prepare import Request, prepare

    tokenizer, trusted, key = args.tokenizer, False, "--tokenizer"
    megatron = None
    include_special_tokens = not args.tokenizer_hf_no_include_special_tokens
    if args.config is not None:
        from coretrain_tokenizer import megatron_type
        from coretrain_tokenizer.megatron import Settings

        import coretrain

        loaded = coretrain.load(args.config)
        config, settings = loaded.config, loaded.config.tokenizer
        types = coretrain.load_plugins(loaded).get("tokenizer")  # Megatron's types: the plugin's table
        if (kind := megatron_type(types)) is not None:
            megatron = {name: getattr(types, name) for name in Settings.PLUGIN_KEYS} | {"path": settings.path}
            tokenizer, key = (
                settings.path or getattr(types, "vocab_file", None) or kind,
                "plugins.tokenizer.tokenizer_type",
            )
        elif settings.path is None:
            raise coretrain.UserError(f'--config {args.config}: no [tokenizer] path; set path = "DIR" there')
        else:
            tokenizer, trusted, key = settings.path, settings.trust_remote_code, "tokenizer.path"
        if config.data.provider == "indexed":  # the documents as the run's fill-in-the-middle encodes its parts
            include_special_tokens &= config.data.options.get("include_special_tokens", True) is not False
    request = Request(
        inputs=args.inputs,
        tokenizer=tokenizer,
        trust_remote_code=trusted,
        tokenizer_key=key,
        megatron=megatron,
        output_prefix=args.output_prefix,
        json_keys=args.json_keys,
        append_eod=args.append_eod,
        include_special_tokens=include_special_tokens,
        workers=args.workers,
        input_format=args.input_format,
        sample_by=args.sample_by,
        log_interval=args.log_interval,
    )
    prepare(request)
    return 0
