"""When a run saves, and what follows a save — decided here, not in the loop (torchtitan's
``checkpointer.save(step)`` decides itself).

A save is due every ``checkpoint.save_interval``, when a plugin asks (``run.control``), and
before stopping — except that a plugin's stop says itself whether its state is worth saving.
Once a save is committed (at once, or later when written in the background) plugins hear
``on_checkpoint_saved``. After the final validation the final checkpoint records what was
evaluated after it, and retention runs once more (a plugin's protected step may have changed since).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coretrain.checkpoint.layout import apply_retention, mark_evaluated, step_dir
from coretrain.checkpoint.writer import Checkpointer, SkippedSave, checkpoint_root, checkpoint_target
from coretrain.hookspecs import Outcome
from coretrain.pluginmanager import hook_calls
from coretrain.run import Run

log = logging.getLogger("coretrain")


class Saves:
    """The run's checkpoints from the loop's side: is one due, write it, say when it is committed."""

    def __init__(self, run: Run, on_saved: Callable[..., None] | None) -> None:
        self.run = run
        self.writer = Checkpointer(run)
        self.on_saved = on_saved
        self.last_step = -1
        """The step of the newest checkpoint this run wrote into ``checkpoints/`` or resumed from."""
        self.target = checkpoint_target(run)
        """A plugin's directory for non-persistent saves (``checkpoint_target``); None: ``checkpoints/``."""
        self.into: Path | None = None
        """Where the due save goes: ``target`` when only non-persistent requests ask for it."""
        self.skip_causes: set[str] = set()
        """Why saves into ``target`` were skipped (each said once)."""

    def due(self, step: int, reason: Outcome | None) -> bool:
        """Whether to save after ``step`` (stopping for ``reason``), and where: a scheduled save,
        a stop's or a persistent request's goes into ``checkpoints/``; a request for a
        non-persistent one alone into ``target`` (``checkpoints/`` when no plugin gives one). A
        plugin's stop saves only if it asked for a persistent checkpoint."""
        requested, persistent = self.run.control.checkpoint_requested, self.run.control.checkpoint_persistent
        if reason == "stopped":
            return requested and persistent
        scheduled = bool(reason or (requested and persistent) or self.run.cadence.saves(step))
        self.into = None if scheduled else self.target
        return scheduled or requested

    def needed(self) -> bool:
        """Whether the state at this step is not saved yet (and saving is on)."""
        return self.run.config.checkpoint.save and self.last_step != self.run.state.step

    def save(self, state: dict[str, Any], evaluated: list[str]) -> None:
        """Write the due save where :meth:`due` decided; ``on_checkpoint_saved`` once it is
        committed (now, or when the background write finishes). The plugins' requests count as
        answered either way, so a save that could not be written is not retried every step."""
        run = self.run
        try:
            _, blocked = self.writer.save(state, evaluated=evaluated, into=self.into)
        except SkippedSave as skipped:  # (agreed: every rank skips it)
            self._skipped(str(skipped), skipped.own)
            return
        finally:  # the requests are answered, saved or not
            run.control.checkpoint_requested = run.control.checkpoint_persistent = False
        if self.into is not None:
            log.info("checkpoint step %d saved in %s in %.3f s (non-persistent)", run.state.step, self.into, blocked)
            return
        self.last_step = run.state.step
        if self.writer.in_flight:
            log.info("checkpoint step %d: training blocked %.3f s; writing in the background", run.state.step, blocked)
        else:
            log.info("checkpoint step %d saved in %.3f s", run.state.step, blocked)
            self.committed(run.state.step)

    def _skipped(self, cause: str, own: bool) -> None:
        """A save into ``target`` that could not be written: said once per cause, by rank 0 and
        by the rank that could not write."""
        kind = cause.split(": ")[0]  # "No space left on device", "Permission denied", or the error's type
        if (self.run.dist.is_main or own) and kind not in self.skip_causes:
            log.warning(
                "non-persistent checkpoint of step %d skipped: %s; training goes on (durable checkpoints still "
                "protect the run; later skips for this cause are not reported)",
                self.run.state.step,
                cause,
            )
        self.skip_causes.add(kind)

    def poll(self) -> None:
        """A background save that finished since: its ``on_checkpoint_saved``."""
        if self.writer.in_flight:
            self.committed(self.writer.done())

    def committed(self, step: int | None) -> None:
        if step is not None and self.on_saved is not None:
            path = step_dir(checkpoint_root(self.run), step)
            self.on_saved(run=self.run, step=step, path=str(path))

    def finish(self, evaluated: list[str]) -> None:
        """The save in flight finishes; the final checkpoint learns what was evaluated after it."""
        self.committed(self.writer.wait())
        run = self.run
        if run.dist.is_main and self.last_step == run.state.step and run.config.checkpoint.save:
            directory = step_dir(checkpoint_root(run), run.state.step)
            mark_evaluated(directory, evaluated)
            kept = hook_calls(run).protected_checkpoints(run=run, root=directory.parent)
            apply_retention(directory.parent, run.config.checkpoint.keep_last, kept)
