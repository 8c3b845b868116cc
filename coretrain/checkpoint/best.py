"""The best checkpoint (``checkpoint.keep_best``): saved at each evaluation that improves a
metric, kept out of ``keep_last``'s deletion, and pointed at by ``checkpoints/best``.

As Lightning's ``ModelCheckpoint(monitor=...)``: the state that was evaluated is the one kept,
so an improving evaluation asks for a checkpoint at its own step (agreed at once: an
evaluation step waits on the ranks anyway). ``best`` is a relative symlink to the step
directory, replaced atomically after the step is committed; the step's manifest records the
metric, its value and the mode, which is where a resumed run reads the best so far. Resume
still takes the newest checkpoint; ``checkpoint.resume``, ``checkpoint.pretrained`` and
``coretrain checkpoint export --step best`` follow the link.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from attrs import define

from coretrain.checkpoint.layout import (
    MANIFEST,
    apply_retention,
    best_step,
    parse_step_dir,
    point_best,
    read_manifest,
    step_dir,
    tidy_best,
    write_json_atomically,
)
from coretrain.errors import UserError
from coretrain.run import Run


@define
class BestCheckpoint:
    """Which evaluation is the best so far, for ``checkpoint.keep_best``."""

    metric: str | None
    mode: str
    value: float | None = None
    step: int | None = None

    @classmethod
    def of(cls, run: Run) -> BestCheckpoint:
        """From ``checkpoint.keep_best``; a run that never evaluates while training is an error."""
        settings = run.config.checkpoint
        if settings.keep_best and settings.save and not run.cadence.eval_every:
            raise UserError(
                f"checkpoint.keep_best = {settings.keep_best!r}, but this run never evaluates during training; "
                "set train.eval_interval (and train.eval_iters or train.eval_full) and give the data provider a "
                "valid split"
            )
        if settings.keep_best and settings.save and run.dist.is_main:
            tidy_best(run.output_dir / "checkpoints")
        return cls(settings.keep_best if settings.save else None, settings.keep_best_mode)

    def evaluated(self, step: int, metrics: dict[str, float]) -> bool:
        """Whether this evaluation is the new best (the caller then saves this step)."""
        if self.metric is None or not any(name.startswith(self.metric.split("/")[0] + "/") for name in metrics):
            return False
        if self.metric not in metrics:
            raise UserError(
                f"checkpoint.keep_best: {self.metric!r} is not among the evaluated metrics "
                f"({', '.join(sorted(metrics))}); set it to one of these"
            )
        value = metrics[self.metric]
        better = self.value is None or (value < self.value if self.mode == "min" else value > self.value)
        if not (math.isfinite(value) and better):
            return False
        self.value, self.step = value, step
        return True

    def manifest_entry(self, step: int) -> dict[str, Any] | None:
        """What the manifest of ``step`` records, when it is the best."""
        if self.step != step or self.value is None:
            return None
        return {"metric": self.metric, "value": self.value, "mode": self.mode}

    def restore(self, root: Path) -> None:
        """The best so far, from the manifest ``root/best`` points at (for the same metric)."""
        step = best_step(root)
        if self.metric is None or step is None or not (step_dir(root, step) / MANIFEST).exists():
            return
        entry = read_manifest(step_dir(root, step)).get("best") or {}
        if entry.get("metric") == self.metric and entry.get("mode") == self.mode:
            self.value, self.step = float(entry["value"]), step

    def mark_saved(self, directory: Path, keep_last: int | None) -> None:
        """The best evaluation's step was saved before it was evaluated (the final validation
        runs after the final save): record it in the manifest and point ``best`` at it (rank 0)."""
        entry = self.manifest_entry(parse_step(directory))
        if entry is None or not (directory / MANIFEST).exists():
            return
        write_json_atomically(directory / MANIFEST, {**read_manifest(directory), "best": entry})
        point_best(directory.parent, directory)
        apply_retention(directory.parent, keep_last)  # the best before it may go now


def parse_step(directory: Path) -> int:
    parsed = parse_step_dir(directory.name)
    return parsed[0] if parsed is not None else -1
