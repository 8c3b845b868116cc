"""Choose the weights and the samples, then run the predictor on a run built from the config."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from coretrain_keep_best.link import require_best

import coretrain
from coretrain import UserError, find_checkpoint
from coretrain_predict.predictor import Predictor


def weights(output_dir: Path, choice: str | None) -> list[str]:
    """``--set`` texts that load the chosen checkpoint's weights (none: the provider's)."""
    if choice == "none":
        return []
    if choice is not None and not choice.isdigit() and choice != "best":
        path = Path(choice)
        if not path.exists():
            raise UserError(f"--checkpoint {choice}: no such checkpoint directory or file")
    else:
        which = int(choice) if choice is not None and choice.isdigit() else choice
        if which == "best":
            require_best(output_dir / "checkpoints", "--checkpoint")
        path = find_checkpoint(output_dir / "checkpoints", which, "--checkpoint")
    return [f"checkpoint.pretrained={json.dumps(str(path.resolve()))}"]


def check_out(out: Path) -> None:
    """``--out`` can be written — before the pass, not after it: its folder is made, and a file
    is created and removed beside where the predictions go (by rank 0, which writes them)."""
    if out.is_dir():
        raise UserError(f"--out {out}: is a directory; give a file name (predictions.jsonl or .parquet)")
    if os.environ.get("RANK", "0") != "0":
        return
    probe = out.with_name(f".{out.name}.{os.getpid()}.probe")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        probe.touch()
        probe.unlink()
    except (FileExistsError, NotADirectoryError):
        raise UserError(f"--out {out}: a folder on its path is a file; choose another path") from None
    except OSError as exc:
        raise UserError(f"--out {out}: cannot write there ({exc.strerror or exc}); choose another path") from None


def predict(args: argparse.Namespace) -> int:
    if args.batch_size is not None and args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size}: expected a positive number")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {args.max_new_tokens}: expected a positive number")
    if args.temperature is not None and args.temperature < 0:
        raise UserError(f"--temperature {args.temperature}: expected 0 (greedy) or more")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UserError(f"--top-p {args.top_p}: expected a share of the probability mass in (0, 1]")
    settings = coretrain.load(args.config, args.overrides).config
    out = Path(args.out)
    check_out(out)
    predictor = Predictor(
        split=args.split or ("prompts" if args.data else "test"),
        data=Path(args.data) if args.data else None,
        out=out.resolve(),
        batch_size=args.batch_size,
        options={
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "do_sample": args.do_sample,
        },
    )
    sets = [
        *args.overrides,
        *weights(Path(settings.output_dir), args.checkpoint),
        f"run.output_dir={json.dumps(str(Path(settings.output_dir) / 'predict'))}",
        "train.skip_train=true",
        'run.log_level="warning"',  # no training banner, no "completed at step 0": this run only predicts
        'checkpoint.resume="never"',
        "checkpoint.save=false",
        "train.eval_iters=0",
        "train.eval_full=false",
        "plugins.early-stopping.enabled=false",
    ]
    coretrain.train(args.config, overrides=sets, plugins={"predict": predictor})
    if predictor.written:  # rank 0 wrote the file
        print(f"predict: {predictor.written}")
    return 0
