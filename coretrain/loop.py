"""The training loop: the order of events documented in :mod:`coretrain.hookspecs`, and nothing else.

Per step the loop does only what a hand-written loop does, plus appending the loss tensor to
a list; everything that needs host values (logging, evaluation, decisions) happens once per
interval or when a plugin asks through ``run.control``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from attrs import frozen

from coretrain.build import planned_steps, raise_first, record_config
from coretrain.checkpoint import pretrained, resume, safeload
from coretrain.checkpoint.layout import step_dir
from coretrain.checkpoint.saves import Saves
from coretrain.checkpoint.state import keeping_rng
from coretrain.checkpoint.writer import checkpoint_root
from coretrain.errors import PluginError, RunFailure, UserError
from coretrain.hookspecs import Outcome
from coretrain.intervallog import IntervalLog
from coretrain.loader import StepPlan, TrainBatches
from coretrain.phases import combined
from coretrain.pluginmanager import hook_calls
from coretrain.run import Run, StepOutputs
from coretrain.signals import SignalWatcher
from coretrain.step import StepNumerics
from coretrain.stopping import StopAgreement

log = logging.getLogger("coretrain")


@frozen
class LoopSettings:
    """What the loop decides once, before the first step, so a step only reads locals."""

    plan: StepPlan
    feed: TrainBatches
    train_iters: int
    per_micro_batch: int
    """Samples one micro-batch reads over all ranks (:attr:`Run.samples_per_micro_batch`)."""
    numerics: StepNumerics
    no_loss: torch.Tensor
    """The loss a step reports whose batch a plugin skipped before the forward pass: NaN."""


class ResolvedHooks:
    """This run's hooks, each None when no plugin implements it (a hook nobody implements costs
    nothing: the loop tests for None instead of calling into pluggy)."""

    def __init__(self, run: Run) -> None:
        calls = hook_calls(run)
        on = calls.implemented
        self.num_micro_batches = calls.hook.num_micro_batches if on("num_micro_batches") else None
        self.pre_step = calls.hook.pre_step if on("pre_step") else None
        self.post_step = calls.hook.post_step if on("post_step") else None
        # the host-side hooks leave the training's random streams untouched (keeping_rng says why)
        self.on_train_start = keeping_rng(calls.hook.on_train_start) if on("on_train_start") else None
        self.on_log = keeping_rng(calls.hook.on_log) if on("on_log") else None
        self.evaluate = keeping_rng(calls.hook.evaluate) if on("evaluate") else None
        self.on_eval = keeping_rng(calls.hook.on_eval) if on("on_eval") else None
        self.on_checkpoint_saved = keeping_rng(calls.hook.on_checkpoint_saved) if on("on_checkpoint_saved") else None
        self.on_signal = keeping_rng(calls.hook.on_signal) if on("on_signal") else None
        self.on_train_end = calls.on_train_end if on("on_train_end") else None


def explained(run: Run, error: Exception) -> RunFailure | None:
    """A plugin's one line for an exception from the model, the data or torch (``explain_failure``)."""
    if isinstance(error, (UserError, RunFailure)) or not hook_calls(run).implemented("explain_failure"):
        return None
    line = hook_calls(run).hook.explain_failure(run=run, error=error)
    return RunFailure(line) if line else None


def plugin_states(run: Run) -> dict[str, Any]:
    """Each plugin's ``on_checkpoint`` state, checked before it reaches the disk: a state no
    run could load again stops the run naming the plugin."""
    path = step_dir(checkpoint_root(run), run.state.step)
    states = {}
    on_checkpoint = keeping_rng(hook_calls(run).on_checkpoint)
    for name, state in on_checkpoint(run=run, step=run.state.step, path=str(path)).items():
        if state is None:
            continue
        try:
            safeload.check_plain(state, "state")
        except TypeError as exc:
            error = TypeError(
                f"returned {exc}; a checkpoint holds tensors, numbers, str, bool, None and lists/dicts of these"
            )
            raise PluginError(name, "on_checkpoint", error, run.state.step) from None
        states[name] = state
    return states


class Trainer:
    """Drives one run from restore to on_train_end; returns the process exit code."""

    def __init__(self, run: Run, signals: SignalWatcher | None = None) -> None:
        self.run = run
        self.hooks = ResolvedHooks(run)
        self.log = IntervalLog(run.device)
        self.in_progress: int | None = None
        """The step being run (from its pre_step to its end), for a failure to name."""
        self.feed: TrainBatches | None = None
        self._data_state: dict[str, Any] | None = None
        """A stream's position from the checkpoint resumed from, for the feed made in _steps."""
        self.evaluated_at: dict[str, int] = {}
        """Split -> the last step it was evaluated (and logged) at."""
        self.saves = Saves(run, self.hooks.on_checkpoint_saved)
        train = run.config.train
        watched = train.exit_signals if train.exit_signal_handler else []
        self.signals = signals or SignalWatcher(watched)
        self.signals.keep_only(watched)  # one installed at start-up by the CLI: what the config asks for
        self.mark = combined(hook_calls(run).phase_listeners(run))
        """``mark(step, phase)`` at each phase boundary, for the plugins that watch or time the loop."""
        self.stops = StopAgreement(run, self.signals, self.hooks.on_signal, self.mark)
        if run.cadence.eval_every and self.hooks.evaluate is None and run.dist.is_main:
            log.warning("train.eval_interval is set, but no plugin evaluates (is `evaluation` disabled?)")

    # ---------------------------------------------------------------- checkpoints

    def restore(self) -> None:
        """Resume from the newest checkpoint that loads (or load pretrained weights)."""
        run = self.run
        candidates, explicit = resume.resume_candidates(run, self.saves.target)
        if not candidates:
            if run.config.checkpoint.pretrained:
                pretrained.load_pretrained(run, run.config.checkpoint.pretrained)
                log.info("loaded pretrained weights from %s", run.config.checkpoint.pretrained)
            return
        with_optimizer = run.config.checkpoint.load_optimizer
        restored = resume.read_newest_loadable(run, candidates, explicit, with_optimizer)
        resume.check_resumable(run, restored.manifest, restored.path)
        resume.apply(run, restored, with_optimizer)
        path, state = restored.path, restored.rank_state
        self._data_state = state.get("data")
        self.log.restore(state.get("interval_log", {}), run.device, run.state.step)
        self.saves.last_step = run.state.step
        self.evaluated_at = {split: run.state.step for split in restored.manifest.get("evaluated", [])}
        keeping_rng(hook_calls(run).on_resume)(run=run, step=run.state.step, states=state.get("plugins", {}))
        log.info("resumed from %s (step %d, %d samples consumed)", path, run.state.step, run.state.consumed_samples)

    def save(self) -> None:
        """The state at this step, with the loop's own parts (unless saved already or saving is off)."""
        run = self.run
        if not self.saves.needed():
            return
        self.mark(run.state.step, "checkpoint")
        self.log.check_finite(run)  # weights updated from a NaN loss are never saved
        data_state = self.feed.state_dict() if self.feed is not None else self._data_state
        state = {
            "plugins": plugin_states(run),
            "interval_log": self.log.pending(),
            **({"interval_log_mean": self.log.pending(True, run.reports_loss)} if run.dist.world_size > 1 else {}),
            **({"data": data_state} if data_state else {}),
        }
        self.saves.save(state, self._evaluated_now())

    # ---------------------------------------------------------------- the loop

    def train(self) -> int:
        """Restore, train, save, validate; ``on_train_end`` for every plugin however it ends."""
        run = self.run
        run.started_at = time.monotonic()
        outcome: Outcome = "error"
        self.mark(run.state.step, "restore")
        try:
            with self.signals:
                self.restore()
                run.train_iters = planned_steps(run)  # the steps ahead, from where the run resumed
                record_config(run)
                outcome = self.stops.before_first_step() or self._train_and_finish()
        except PluginError as exc:
            if exc.step is None:  # a hook without a step argument: the step it failed in
                exc.step = self.in_progress if self.in_progress is not None else run.state.step
            raise
        except Exception as exc:
            if (failure := explained(run, exc)) is None:
                raise
            raise failure from exc
        finally:
            self.mark(run.state.step, "end")
            if outcome == "error" and self.saves.writer.in_flight:
                with contextlib.suppress(Exception):  # the error in hand is the one to report
                    self.saves.writer.wait()
            self._end(outcome)
        if outcome == "signal" and self.stops.signum is not None:
            return 128 + self.stops.signum
        return run.control.exit_code if outcome == "stopped" else 0

    def _train_and_finish(self) -> Outcome:
        """on_train_start, the steps and, when they completed, the final save and validation."""
        run = self.run
        if self.hooks.on_train_start:
            self.hooks.on_train_start(run=run)
        skip_train = run.config.train.skip_train
        outcome: Outcome = "completed" if skip_train else self._steps()
        if outcome == "completed":  # an exit condition means "stop now", as in Megatron
            if not skip_train:  # (an evaluation alone changed no weight: nothing to save, as in Megatron)
                self.save()  # the trained weights first: a failing validation cannot lose them
            self._final_eval()
        self.saves.finish(self._evaluated_now())  # a save in flight finishes before we leave
        return outcome

    def _end(self, outcome: Outcome) -> None:
        """on_train_end on every plugin, even past one that raises; the first failure is re-raised
        unless the run is already failing with another error."""
        run = self.run
        if not self.hooks.on_train_end:
            return
        errors = self.hooks.on_train_end(run=run, outcome=outcome)
        for error in errors:
            if isinstance(error, PluginError) and error.step is None:
                error.step = run.state.step
        raise_first(errors, failing=outcome == "error")

    def _final_eval(self) -> None:
        """After training: validation (unless done at this step) and the test split, once each."""
        for split in ("valid", "test"):
            if self.evaluated_at.get(split) != self.run.state.step:
                self._eval(split)

    def _evaluated_now(self) -> list[str]:
        return sorted(split for split, step in self.evaluated_at.items() if step == self.run.state.step)

    def _eval(self, split: str = "valid") -> None:
        """Evaluate each dataset of ``split`` (one, or several by name) if a plugin evaluates
        them; hand their metrics to on_eval together."""
        run = self.run
        sets = run.datasets.sets(split)
        if not sets or self.hooks.evaluate is None:
            return
        self.mark(run.state.step, "eval")
        results = [self.hooks.evaluate(run=run, split=name, dataset=dataset) for name, dataset in sets]
        if None in results:
            return
        metrics = {name: value for result in results if result is not None for name, value in result.items()}
        self.evaluated_at[split] = run.state.step
        if self.hooks.on_eval:
            self.hooks.on_eval(run=run, step=run.state.step, metrics=metrics)

    def _steps(self) -> Outcome:
        """The loop drawn in :mod:`coretrain.hookspecs`, one helper per line of it."""
        run, hooks, state, mark = self.run, self.hooks, self.run.state, self.mark
        loop = self._loop_settings()
        run.model.train()  # dropout on, as the Trainer has it: from_pretrained hands a model over in eval mode
        while state.step < loop.train_iters:
            step = self.in_progress = state.step + 1
            n_micro, consumed = loop.plan.at(step)
            run.micro_batches_per_step = n_micro
            global_batch = loop.per_micro_batch * n_micro
            if hooks.pre_step:
                mark(step, "pre_step")
                hooks.pre_step(run=run, step=step)

            mark(step, "data")
            batches = loop.feed.step(step, n_micro, consumed)
            if loop.numerics.skips_batch(step):  # vetoed in pre_step: the batch is drawn, nothing runs
                loss, values, skipped, grad_norm = loop.no_loss, None, True, None
            else:
                mark(step, "forward_backward")
                loss, values = loop.numerics.forward_backward(batches)
                mark(step, "update")
                while (update := loop.numerics.update(step, loss, global_batch)) is None:  # skip_update(rerun=True)
                    loss, values = loop.numerics.forward_backward(batches)
                skipped, grad_norm = update
            mark(step, "post_step")

            state.step, state.consumed_samples = step, state.consumed_samples + global_batch
            self.log.add(loss, grad_norm, values, step, skipped)  # device tensors: no sync
            if hooks.post_step:
                done = StepOutputs(
                    loss=loss.detach(), grad_norm=grad_norm, skipped=skipped, global_batch_size=global_batch
                )
                hooks.post_step(run=run, step=step, outputs=done)
            reason = self._after_step(step)
            self.in_progress = None
            if reason is not None:
                return reason
        self.stops.finish()
        return "completed"

    def _after_step(self, step: int) -> Outcome | None:
        """Log (the interval's one host sync), evaluate, save and agree on stopping, each when the
        cadence or a request says; why training stops now, or None."""
        run, mark = self.run, self.mark
        if run.cadence.logs(step):
            mark(step, "log")
            self._log(step)
        if run.cadence.evaluates(step):
            self._eval("valid")
        self.saves.poll()
        reason = self.stops.after(step)
        if self.saves.due(step, reason):
            self.save()
        if reason is not None:
            log.info("stopping at step %d: %s", step, run.control.stop_reason or reason)
            self.stops.finish()
        return reason

    def _loop_settings(self) -> LoopSettings:
        """What the loop decides once, before the first step."""
        run = self.run
        state = run.state
        plan = StepPlan(self._micro_batches_deciding(), run.samples_per_micro_batch, state.step, state.consumed_samples)
        self.feed = TrainBatches(run, plan, state.step + 1, self._data_state)
        self.stops.start()
        return LoopSettings(
            plan=plan,
            feed=self.feed,
            train_iters=run.train_iters,
            per_micro_batch=run.samples_per_micro_batch,
            numerics=StepNumerics(run),
            no_loss=torch.full((), float("nan"), device=run.device),
        )

    def _log(self, step: int) -> None:
        """The interval's metrics with its one host sync, then on_log."""
        metrics = self.log.flush(self.run)
        if self.hooks.on_log:
            self.hooks.on_log(run=self.run, step=step, metrics=metrics)

    def _micro_batches_deciding(self) -> Callable[[int, int], int]:
        """Micro-batches for (step, consumed samples): a plugin's answer (rampup) or the configured."""
        run, hook, default = self.run, self.hooks.num_micro_batches, self.run.micro_batches_per_step
        if hook is None:
            return lambda step, consumed: default
        return lambda step, consumed: hook(run=run, step=step, consumed_samples=consumed) or default
