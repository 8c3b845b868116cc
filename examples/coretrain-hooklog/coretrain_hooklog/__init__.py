"""``hooklog``: write one JSON line per hook call, to see (and test) what a run does.

A complete third-party plugin in one file: an attrs class whose fields are its
``[plugins.hooklog]`` table, methods marked with ``coretrain.hookimpl``, and an entry point
in the ``coretrain`` group (see pyproject.toml). It also keeps state across resume, writes
on rank 0 only (as loggers do), and adds a command: ``coretrain hooklog RUN_DIR`` counts the
calls, through the ``coretrain.commands`` entry-point group.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attrs import define, field

from coretrain import Outcome, Run, hookimpl


@define(kw_only=True)
class HookLog:
    """Records every hook call of the run to a JSON-lines file."""

    path: str = "hooklog.jsonl"
    """File to append to, relative to the run's output dir."""
    every_step: bool = False
    """Also record pre_step/post_step (off: those run every step)."""
    steps_seen: int = field(default=0, init=False)

    coretrain_hook_api = (1, 0)  # the hook contract this plugin was written for

    def _record(self, run: Run, hook: str, **details: Any) -> None:
        if not run.dist.is_main:  # every rank calls the hooks; one writes
            return
        with open(Path(run.output_dir) / self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"hook": hook, **details}) + "\n")

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        self._record(run, "on_train_start", step=run.state.step)

    @hookimpl
    def post_step(self, run: Run, step: int) -> None:
        self.steps_seen += 1
        if self.every_step:
            self._record(run, "post_step", step=step)

    @hookimpl
    def on_log(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        self._record(run, "on_log", step=step, loss=metrics["loss"])

    @hookimpl
    def on_eval(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        self._record(run, "on_eval", step=step, **metrics)

    @hookimpl
    def on_checkpoint(self, run: Run, step: int) -> dict[str, Any]:
        self._record(run, "on_checkpoint", step=step)
        return {"steps_seen": self.steps_seen}

    @hookimpl
    def on_resume(self, run: Run, step: int, state: dict[str, Any]) -> None:
        self.steps_seen = state.get("steps_seen", 0)
        self._record(run, "on_resume", step=step, steps_seen=self.steps_seen)

    @hookimpl
    def on_train_end(self, run: Run, outcome: Outcome) -> None:
        self._record(run, "on_train_end", step=run.state.step, outcome=outcome, steps_seen=self.steps_seen)


def add(commands: Any) -> None:
    """``coretrain hooklog RUN_DIR``: how many times each hook was called (entry point
    ``hooklog`` in the ``coretrain.commands`` group)."""
    command = commands.add_parser("hooklog", help="count the hook calls a run's hooklog recorded")
    command.add_argument("run_dir", help="the run's output dir")
    command.add_argument("--path", default="hooklog.jsonl", help="the log, relative to RUN_DIR")
    command.set_defaults(handler=count_calls)


def count_calls(args: Any) -> int:
    from collections import Counter

    from coretrain import UserError

    log = Path(args.run_dir) / args.path
    if not log.is_file():
        raise UserError(f"{log}: no hook log here; run with [plugins.hooklog] first")
    counts = Counter(json.loads(line)["hook"] for line in log.read_text(encoding="utf-8").splitlines() if line)
    for hook, n in sorted(counts.items()):
        print(f"{hook}: {n}")
    return 0
