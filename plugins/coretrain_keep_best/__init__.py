"""``keep-best``: keep the checkpoint of the best evaluation, as Lightning's
``ModelCheckpoint(monitor=...)`` does; ``checkpoints/best`` points at it.

Each evaluation that improves ``metric`` asks for a checkpoint at its own step (agreed at once:
evaluated metrics are the same on every rank, and a request made at an evaluation step is
honoured at that step), so the state that was evaluated is the one kept. Once that checkpoint
is committed (``on_checkpoint_saved``), rank 0 points ``checkpoints/best`` — a relative link,
replaced atomically — at it. Retention never deletes the step ``best`` points at (this plugin's
answer to ``protected_checkpoints``),
and ``checkpoint.resume``, ``checkpoint.pretrained``, ``coretrain predict --checkpoint best``
and ``checkpoint export --step best`` follow the link. The best so far is saved in every
checkpoint, so a resumed run (which still resumes from the newest) knows it.

Formerly ``checkpoint.keep_best`` / ``checkpoint.keep_best_mode``: those keys still work, with
one deprecation warning naming ``plugins.keep-best.metric`` / ``.mode``.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Literal

from attrs import define, field

from coretrain import Run, UserError, hookimpl, non_negative, read_manifest, step_dir
from coretrain_keep_best.link import best_step, point_best, tidy_best

log = logging.getLogger("coretrain")


@define(kw_only=True)
class BestSoFar:
    """What keep-best keeps in a checkpoint; a resume checks a saved state against it."""

    metric: str
    mode: Literal["min", "max"]
    value: float | None
    step: int | None = field(validator=non_negative)


@define(kw_only=True)
class KeepBest:
    """Save the step of each evaluation that improves ``metric``; ``checkpoints/best`` points at the best."""

    coretrain_state = BestSoFar

    metric: str
    """An evaluated metric: ``valid/loss``, ``valid/accuracy``, ``valid/NAME/loss``, or a value
    your model or a plugin's ``on_eval`` adds."""
    mode: Literal["min", "max"] = "min"
    """"min": lower is better (a loss); "max": higher is better (accuracy)."""
    value: float | None = field(default=None, init=False)
    step: int | None = field(default=None, init=False)
    committed: int | None = field(default=None, init=False)
    """The newest step whose checkpoint is committed."""

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        if not run.config.checkpoint.save:
            return
        if not run.cadence.eval_every and not run.config.train.skip_train:
            raise UserError(
                f"plugins.keep-best.metric = {self.metric!r}, but this run never evaluates during training; set "
                "train.eval_interval (and train.eval_iters or train.eval_full) and give the data provider a valid split"
            )
        if run.dist.is_main:
            root = run.output_dir / "checkpoints"
            tidy_best(root)
            if self.step is not None and best_step(root) != self.step and step_dir(root, self.step).is_dir():
                point_best(root, self.step)  # the run's own best, where the link was lost or replaced

    @hookimpl(trylast=True)  # after tryfirst on_eval implementations added their metrics
    def on_eval(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        if not run.config.checkpoint.save or not any(n.startswith(self.metric.split("/")[0] + "/") for n in metrics):
            return  # nothing is saved, or another split's evaluation (test after training)
        if self.metric not in metrics:
            raise UserError(
                f"plugins.keep-best.metric: {self.metric!r} is not among the evaluated metrics "
                f"({', '.join(sorted(metrics))}); set it to one of these"
            )
        value = metrics[self.metric]
        better = self.value is None or (value < self.value if self.mode == "min" else value > self.value)
        if not (math.isfinite(value) and better):
            return
        self.value, self.step = value, step
        if self.committed == step:  # the final validation runs after the final save
            self._point(run, step)
        else:
            run.control.request_checkpoint()

    @hookimpl
    def on_checkpoint_saved(self, run: Run, step: int) -> None:
        self.committed = step
        if step == self.step:
            self._point(run, step)

    def _point(self, run: Run, step: int) -> None:
        if run.dist.is_main:
            point_best(run.output_dir / "checkpoints", step)

    @hookimpl
    def protected_checkpoints(self, root: Path) -> list[int]:
        """Retention keeps the step ``best`` points at."""
        step = best_step(root)
        return [] if step is None else [step]

    @hookimpl
    def on_checkpoint(self) -> dict[str, Any]:
        return {"metric": self.metric, "mode": self.mode, "value": self.value, "step": self.step}

    @hookimpl
    def on_resume(self, run: Run, state: dict[str, Any]) -> None:
        saved = state or _from_manifest(run.output_dir / "checkpoints")  # {}: a checkpoint of an older coretrain
        if saved.get("metric") == self.metric and saved.get("mode") == self.mode:
            self.value, self.step = saved["value"], saved["step"]


def _from_manifest(root: Path) -> dict[str, Any]:
    """The best so far as 0.2's ``checkpoint.keep_best`` recorded it: the ``best`` entry of the
    manifest ``best`` points at. An entry that is not ``{metric, mode, value}`` is not used (the
    best starts afresh, said once): it is this plugin's to read, and the core does not check it."""
    step = best_step(root)
    if step is None:
        return {}
    entry = read_manifest(step_dir(root, step)).get("best")
    if entry is None:
        return {}
    if _legacy_entry(entry):
        return {**entry, "step": step}
    log.warning(
        "keep-best: the 'best' entry of step %d's checkpoint.json is not one it wrote; the best starts afresh", step
    )
    return {}


def _legacy_entry(entry: Any) -> bool:
    """``{"metric": str, "mode": "min" | "max", "value": a number}``, as 0.2 wrote it."""
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("metric"), str)
        and entry.get("mode") in ("min", "max")
        and type(entry.get("value")) in (int, float)
    )
