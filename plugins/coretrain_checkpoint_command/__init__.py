"""``coretrain checkpoint list | export``: look into a run's checkpoints without building the run.

A command plugin (``coretrain.commands``) that also owns the ``export_model`` hook it asks of
format plugins (``safetensors``, ``hf``).
"""

from __future__ import annotations

import argparse
from typing import Any


def add(commands: Any) -> None:
    """Add this module's command(s) to ``coretrain``'s subcommands."""
    ckpt = commands.add_parser("checkpoint", help="inspect and export a run's checkpoints")
    ckpt_commands = ckpt.add_subparsers(dest="checkpoint_command", required=True, metavar="SUBCOMMAND")
    listing = ckpt_commands.add_parser("list", help="steps, sizes, complete or not")
    listing.add_argument("run_dir", help="the run's output dir (holds checkpoints/)")
    listing.set_defaults(handler=cmd_checkpoint_list)
    export = ckpt_commands.add_parser(
        "export", help="model weights of a checkpoint: one .safetensors file, or a plugin's format (hf)"
    )
    export.add_argument("run_dir", help="the run's output dir (holds checkpoints/)")
    export.add_argument(
        "--step",
        type=step_or_best,
        default=None,
        help="a step, or best (the keep-best plugin); default: the newest",
    )
    export.add_argument(
        "--to",
        "--out",  # predict's name for its output, taken here too
        required=True,
        help="output: a file for safetensors (model.safetensors), a new directory for hf",
    )
    export.add_argument(
        "--format",
        default="safetensors",
        dest="export_format",
        metavar="NAME",
        help="safetensors (default), or a format a plugin of the run writes: hf (a save_pretrained directory)",
    )
    export.add_argument("--merge-lora", action="store_true", help="with LoRA: merge the adapters into the base weights")
    export.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="run the code a custom architecture or tokenizer ships (hf); never taken from the run directory",
    )
    export.set_defaults(handler=cmd_checkpoint_export)


def step_or_best(text: str) -> int | str:
    if text == "best":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step number or 'best', got {text!r}") from None


def cmd_checkpoint_list(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coretrain import linked_step
    from coretrain_checkpoint_command.export import list_checkpoints

    found = list_checkpoints(Path(args.run_dir))
    latest = Path(args.run_dir) / "checkpoints" / "latest"
    newest = latest.read_text().strip() if latest.exists() else "-"
    best = linked_step(Path(args.run_dir) / "checkpoints" / "best")
    print(f"{'step':>10}  {'size':>10}  state            path")
    for info in found:
        state = ("complete" if info.complete else "incomplete") + (" best" if info.step == best else "")
        print(f"{info.step:>10}  {info.size_bytes / 2**20:>8.1f}MB  {state:<15}  {info.path}")
    print(f"{len(found)} checkpoint(s); {sum(i.complete for i in found)} complete; latest: {newest}")
    for line in elsewhere(Path(args.run_dir)):
        print(line)
    return 0


def elsewhere(run_dir: Any) -> list[str]:
    """What the run's plugins (its config.toml's) keep outside checkpoints/ on this host."""
    from typing import cast

    import coretrain
    from coretrain import UserError
    from coretrain_checkpoint_command.hookspecs import CheckpointSpecs

    if not (run_dir / "config.toml").is_file():
        return []
    try:
        plugins = coretrain.load_plugins(run_dir / "config.toml", autoload=True)
    except UserError:  # the run's plugins are not installed here, or its config no longer loads
        return []
    found = cast(CheckpointSpecs, plugins.calls.hook).describe_checkpoints(run_dir=run_dir)
    return [line for lines in cast("list[list[str]]", found) for line in lines]


def cmd_checkpoint_export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from coretrain_checkpoint_command.export import export

    options = {"merge_lora": args.merge_lora, "trust_remote_code": args.trust_remote_code}
    print(export(Path(args.run_dir), args.step, Path(args.to), args.export_format, options))
    return 0
