"""Run the range test on a copy of the run's settings, then report and plot what it found."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import coretrain
from coretrain import UserError
from coretrain_lr_find.finder import LRFinder

MIN_STEPS = 20
"""Fewer leaves too little of the curve once its ends are skipped."""


RULES = {
    "steepest": "steepest fall against log(lr)",
    "lightning": "steepest fall against lr: Lightning's rule",
    "minimum/10": "lowest loss's lr / 10: fastai's rule",
}


def lr_find(
    config: str, sets: list[str], min_lr: float, max_lr: float, steps: int, diverge: float, rule: str = "steepest"
) -> int:
    if not 0 < min_lr < max_lr:
        raise UserError(f"lr-find: expected 0 < --min-lr < --max-lr, got {min_lr:g} and {max_lr:g}")
    if steps < MIN_STEPS:
        raise UserError(f"lr-find: --steps {steps} is too few for a curve; use at least {MIN_STEPS}")
    settings = coretrain.load(config, sets).config
    out = Path(settings.output_dir) / "lr_find"
    length = (
        [f"train.train_samples={steps * (settings.train.global_batch_size or settings.train.micro_batch_size)}"]
        if settings.train.train_samples is not None
        else [f"train.train_iters={steps}"]
    )
    finder = LRFinder(min_lr=min_lr, max_lr=max_lr, steps=steps, diverge=diverge)
    sweep = [
        *sets,
        f"run.output_dir={json.dumps(str(out))}",
        *length,
        "checkpoint.save=false",
        'checkpoint.resume="never"',  # a fresh model each time: the sweep's own state is not worth keeping
        "train.eval_iters=0",
        "train.eval_full=false",
        "plugins.early-stopping.enabled=false",
    ]
    coretrain.train(counted_in_steps(config, settings), overrides=sweep, plugins={"lr-find": finder})
    write(out, finder)
    found = finder.suggestions()
    if not found:
        if not any(math.isfinite(loss) for loss in finder.losses):
            raise UserError("lr-find: no finite loss was recorded; lower --min-lr")
        raise UserError(
            f"lr-find: the loss diverged after {len(finder.losses)} of {steps} steps (lr {finder.lrs[-1]:.3g}), "
            "too little of the curve for any rule; lower --max-lr"
        )
    print(f"lr-find: {len(finder.lrs)} steps from {min_lr:g} to {finder.lrs[-1]:.3g}; wrote {out}")
    for name, lr in found.items():
        print(f"  {name:<11} {lr:<9.3g} ({RULES[name]})")
    chosen = choose(found, rule)
    if chosen != rule:
        print(f"  (--rule {rule}: the curve before the loss diverged is too short for it)")
    print(f"suggested ({chosen}): --set optimizer.lr={found[chosen]:.3g}")
    return 0


def choose(found: dict[str, float], rule: str) -> str:
    """The rule asked for, or, when the curve is too short for it (the loss diverged early),
    the first that found a rate."""
    return rule if rule in found else next(iter(found))


def counted_in_steps(config: str, settings: Any) -> str | dict[str, Any]:
    """The config a sweep of N steps runs: a run counted in epochs is the same run counted in
    steps (a sweep of its length in epochs would be as long as the training)."""
    if settings.train.train_epochs is None:
        return config
    data: dict[str, Any] = coretrain.config_as_dict(settings)
    data["train"] = {key: value for key, value in data["train"].items() if key != "train_epochs"}
    return data


def write(out: Path, finder: LRFinder) -> None:
    """lr_find.jsonl always; lr_find.png when matplotlib is installed (the report extra)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lr_find.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in finder.rows())
    try:
        import matplotlib
    except ImportError:
        print("lr-find: no plot without matplotlib (pip install 'coretrain-plugins[report]')")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
    axes.plot(finder.lrs, finder.losses, alpha=0.3, label="loss")
    axes.plot(finder.lrs, finder.smoothed, label="smoothed")
    for (name, lr), colour in zip(finder.suggestions().items(), ("red", "green")):
        axes.axvline(lr, color=colour, linestyle="--", label=f"{name}: {lr:.3g}")
    axes.set(xscale="log", xlabel="learning rate", ylabel="loss", title="lr-find")
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize="small")
    figure.tight_layout()
    figure.savefig(out / "lr_find.png")
    plt.close(figure)
