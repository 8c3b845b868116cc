"""``wandb``: the run in Weights & Biases — config, metrics by step, tags (rank 0).

``mode`` is W&B's own: "online" (needs ``WANDB_API_KEY`` or ``wandb login``), "offline" (a run
directory under ``<output_dir>/wandb`` to ``wandb sync`` later) or "disabled"; unset follows
``WANDB_MODE``, else online. W&B's capture of the terminal is off (the progress view owns it).

A :class:`~coretrain_backends.LoggingBackend` (after every other plugin, rank 0 only). The W&B
run id is saved in checkpoints, so a resumed job continues the same run; a signal marks the run
as preempting; every way a run ends finishes it, with exit code 1 after an exception. Needs
``pip install 'coretrain-plugins[wandb]'``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from attrs import define, field
from coretrain_backends import LoggingBackend

from coretrain import Outcome, Run, UserError, hookimpl, require


def _logged_in(wandb: Any) -> bool:
    """Whether W&B has an API key (env, netrc or settings); asking never prompts."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return bool(wandb.Api().api_key)
    except wandb.errors.UsageError:  # "No API key configured"
        return False


@define(kw_only=True)
class WandB(LoggingBackend):
    """Log the run to Weights & Biases, online or offline."""

    mode: Literal["online", "offline", "disabled"] | None = None
    """Unset = WANDB_MODE, else "online"."""
    project: str | None = None
    """Unset = WANDB_PROJECT, else run.name."""
    entity: str | None = None
    """W&B entity (team or user); unset: the login's default."""
    name: str | None = None
    """The run's display name; unset = run.name."""
    group: str | None = None
    """W&B run group."""
    tags: list[str] = field(factory=list)
    """Tags put on the W&B run."""
    dir: str | None = None
    """Where W&B keeps its files; unset = <run.output_dir> (it adds wandb/)."""
    _run: Any = field(default=None, init=False, repr=False)  # the wandb Run

    def open(self, run: Run) -> None:
        wandb = require("wandb", needed_by="plugins.wandb", extra="wandb")
        mode = self.mode or os.environ.get("WANDB_MODE") or "online"
        if mode == "online" and not _logged_in(wandb):
            raise UserError(
                "plugins.wandb: not logged in to W&B; set WANDB_API_KEY, run `wandb login`, "
                'or log locally with plugins.wandb.mode = "offline"'
            )
        directory = Path(self.dir) if self.dir else Path(run.output_dir)
        directory.mkdir(parents=True, exist_ok=True)
        from coretrain import config_as_dict

        self._run = wandb.init(
            mode=mode,
            dir=str(directory),
            project=self.project or os.environ.get("WANDB_PROJECT") or run.config.run.name,
            entity=self.entity,
            name=self.name or run.config.run.name,
            group=self.group,
            tags=list(self.tags) or None,
            config=config_as_dict(run.config),
            id=self.resumed_id,
            resume="allow" if self.resumed_id else None,
            settings=wandb.Settings(console="off"),
        )
        self._run.summary["world_size"] = run.dist.world_size

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def run_id(self) -> str | None:
        run_id: str | None = self._run.id
        return run_id

    @hookimpl(trylast=True)
    def on_signal(self) -> None:
        if self._run is not None:
            self._run.mark_preempting()

    def close(self, outcome: Outcome) -> None:
        wandb_run, self._run = self._run, None
        wandb_run.summary["outcome"] = outcome
        wandb_run.finish(exit_code=1 if outcome == "error" else 0)
