"""The training loop: the order of events documented in :mod:`coretrain.hookspecs`, and nothing else.

Per step the loop does only what a hand-written loop does, plus appending the loss tensor to
a list; everything that needs host values (logging, evaluation, decisions) happens once per
interval or when a plugin asks through ``run.control``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from typing import Any

import torch

from coretrain import checkpoint, outputs, resume, safeload
from coretrain import metrics as derived
from coretrain.dist import max_over_ranks, sum_over_ranks
from coretrain.errors import PluginError, RunFailure
from coretrain.evaluate import Evaluator, autocast
from coretrain.loader import StepPlan, TrainBatches
from coretrain.run import Run, StepOutputs
from coretrain.signals import SignalWatcher
from coretrain.timers import PhaseTimes

log = logging.getLogger("coretrain")

INPUT_BOUND_SHARE = 0.3
"""A run whose slowest rank waits this share of a step for data is told so, once."""
STOP_REASONS = ("exit_interval", "exit_duration", "stopped", "signal")  # codes 1..4, agreed across ranks


class ResolvedHooks:
    """The hooks of this run, each None when no plugin implements it (so it costs nothing)."""

    def __init__(self, run: Run) -> None:
        for name in (
            "num_micro_batches",
            "pre_step",
            "before_update",
            "post_step",
            "on_log",
            "on_eval",
            "on_train_start",
            "on_train_end",
            "on_signal",
            "on_checkpoint_saved",
        ):
            setattr(self, name, getattr(run.plugins.hook, name) if run.plugins.implemented(name) else None)


class IntervalLog:
    """The steps since the last log, turned into floats with one host sync at flush.

    Per step this only appends references to the loss, grad-norm and the model's named-value
    tensors (no device op, no allocation); the backward graph they point to is already freed,
    so holding them for one interval costs a few hundred bytes each.
    """

    def __init__(self, device: torch.device) -> None:
        self.losses: list[torch.Tensor] = []
        self.grad_norms: list[torch.Tensor] = []
        self.values: dict[str, list[torch.Tensor]] = {}
        self.samples = 0
        self.timed_steps = 0
        self.started = time.perf_counter()
        self.times = PhaseTimes(device)

    def add(
        self, loss: torch.Tensor, grad_norm: torch.Tensor | None, samples: int, values: dict[str, torch.Tensor] | None
    ) -> None:
        self.losses.append(loss)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)
        if values:
            for name, value in values.items():
                self.values.setdefault(name, []).append(value)
        self.samples += samples
        self.timed_steps += 1

    def restart_clock(self) -> None:
        """Leave the steps so far out of the rates and phase times (warm-up: compilation, caches)."""
        self.samples, self.timed_steps, self.started = 0, 0, time.perf_counter()
        self.times.reset()

    def flush(self, run: Run) -> dict[str, float]:
        world, rank = run.dist.world_size, run.dist.rank
        times = self.times.collect(self.timed_steps)  # host values; CUDA events read once complete
        with torch.no_grad():
            means = [torch.stack(self.losses).float().mean()]
            if self.grad_norms:
                means.append(torch.stack(self.grad_norms).float().mean())
            named = [f"train/{name}" for name in self.values]
            means.extend(torch.stack(values).float().mean() for values in self.values.values())
            extra = list(run.log_tensors)
            means.extend(run.log_tensors[name].detach().float().to(means[0].device) for name in extra)
            run.log_tensors.clear()
            device = means[0].device
            host_values = torch.tensor(
                [*times.values(), *(times["time/data"] if r == rank else 0.0 for r in range(world))], device=device
            )
            # the interval's one collective and host sync: sums over ranks, then means on the host
            summed = sum_over_ranks(torch.cat([torch.stack(means), host_values])).tolist()
        host = [value / world for value in summed[: len(means) + len(times)]]
        data_waits = summed[len(means) + len(times) :]  # each rank's own slot
        elapsed = time.perf_counter() - self.started
        timed = self.timed_steps
        metrics = {"loss": host[0], "lr": run.scheduler.last_lr}
        if self.grad_norms:
            metrics["grad_norm"] = host[1]
        metrics.update(zip(named + extra, host[len(means) - len(named) - len(extra) : len(means)]))
        metrics.update(zip(times, host[len(means) :]))
        metrics["time/data_max"] = max(data_waits)
        metrics.update(
            {
                "global_batch_size": float(run.global_batch_size),
                "iteration_time": elapsed / timed if timed else 0.0,
                "samples_per_second": self.samples / elapsed if timed and elapsed > 0 else 0.0,
                "consumed_samples": float(run.state.consumed_samples),
                "skipped_updates": float(run.state.skipped_updates),
            }
        )
        seq_length = run.datasets.seq_length
        if seq_length:
            metrics["tokens_per_second"] = metrics["samples_per_second"] * seq_length
        metrics.update(
            derived.throughput(
                run, metrics["samples_per_second"], metrics["iteration_time"], time.monotonic() - run.started_at
            )
        )
        metrics.update(derived.memory(run.device))
        if metrics["iteration_time"] > 0:
            metrics["time/step"] = metrics["iteration_time"]
        self.losses, self.grad_norms, self.values = [], [], {}
        self.restart_clock()
        return metrics

    def pending(self) -> dict[str, Any]:
        """What a checkpoint must carry so the next log after resume averages the same steps."""
        if not self.losses:
            return {}
        with torch.no_grad():
            return {
                "losses": torch.stack(self.losses).cpu(),
                "samples": self.samples,
                "grad_norms": torch.stack(self.grad_norms).cpu() if self.grad_norms else torch.empty(0),
                "values": {name: torch.stack(values).cpu() for name, values in self.values.items()},
            }

    def restore(self, state: dict[str, Any], device: torch.device) -> None:
        if state:
            self.losses = list(state["losses"].to(device).unbind())
            self.grad_norms = list(state["grad_norms"].to(device).unbind())
            self.values = {name: list(values.to(device).unbind()) for name, values in state.get("values", {}).items()}
            self.samples = int(state["samples"])


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or the CPU allocator's RuntimeError."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "can't allocate memory" in str(exc)


def out_of_memory(run: Run, exc: BaseException) -> str:
    """One line with the sizes that decide memory, and what to lower."""
    params = sum(p.numel() for p in run.model.parameters()) if run.model is not None else 0
    seq = run.datasets.seq_length if run.datasets is not None else None
    shape = f"micro_batch_size {run.config.train.micro_batch_size}" + (f" × seq_length {seq}" if seq else "")
    text = str(exc)
    detail = (
        text[text.index("you tried") :].split(".")[0]
        if "you tried" in text
        else next((line for line in text.splitlines() if line.strip()), type(exc).__name__)[:160]
    )
    return (
        f"out of memory at step {run.state.step + 1} on {run.device} ({shape}, model {params / 1e6:.1f}M "
        f"parameters): {detail}; lower train.micro_batch_size (global_batch_size stays, through "
        "gradient accumulation) or the model size"
    )


class Trainer:
    """Drives one run from restore to on_train_end; returns the process exit code."""

    def __init__(self, run: Run, signals: SignalWatcher | None = None) -> None:
        self.run = run
        self.hooks = ResolvedHooks(run)
        self.log = IntervalLog(run.device)
        self.last_saved_step = -1
        self.feed: TrainBatches | None = None
        self._said_input_bound = False
        self._data_state: dict[str, Any] | None = None
        """A stream's position from the checkpoint resumed from, for the feed made in _steps."""
        self.evaluated_at: dict[str, int] = {}
        """Split -> the last step it was evaluated (and logged) at."""
        self._evaluators: dict[str, Evaluator] = {}
        self.checkpointer = checkpoint.Checkpointer(run)
        train = run.config.train
        watched = train.exit_signals if train.exit_signal_handler else []
        if signals is None:
            signals = SignalWatcher(watched)
        else:  # installed at start-up by the CLI: keep watching what the config asks for
            signals.keep_only(watched)
        self.signals = signals
        self.signum: int | None = None

    # ---------------------------------------------------------------- checkpoints

    def restore(self) -> None:
        """Resume from the newest checkpoint that loads (or load pretrained weights)."""
        run = self.run
        candidates, explicit = resume.resume_candidates(run)
        if not candidates:
            if run.config.checkpoint.pretrained:
                resume.load_pretrained(run, run.config.checkpoint.pretrained)
                log.info("loaded pretrained weights from %s", run.config.checkpoint.pretrained)
            return
        with_optimizer = run.config.checkpoint.load_optimizer
        restored = resume.read_newest_loadable(run, candidates, explicit, with_optimizer)
        resume.check_resumable(run, restored.manifest, restored.rank_state)
        resume.apply(run, restored, with_optimizer)
        path, state = restored.path, restored.rank_state
        self._data_state = state.get("data")
        self.log.restore(state.get("interval_log", {}), run.device)
        self.last_saved_step = run.state.step
        self.evaluated_at = {split: run.state.step for split in restored.manifest.get("evaluated", [])}
        plugin_states = state.get("plugins", {})
        run.plugins.call_each(
            "on_resume", run=run, step=run.state.step, per_plugin=lambda name: {"state": plugin_states.get(name, {})}
        )
        log.info("resumed from %s (step %d, %d samples consumed)", path, run.state.step, run.state.consumed_samples)

    def save(self) -> None:
        run = self.run
        if not run.config.checkpoint.save or self.last_saved_step == run.state.step:
            return
        path = checkpoint.step_dir(checkpoint.checkpoint_root(run), run.state.step)
        plugin_states = {}
        for name, state in run.plugins.call_each("on_checkpoint", run=run, step=run.state.step, path=str(path)).items():
            if state is None:
                continue
            try:  # a state no run could load again must not reach the disk
                safeload.check_plain(state, "state")
            except TypeError as exc:
                raise PluginError(
                    name,
                    "on_checkpoint",
                    TypeError(
                        f"returned {exc}; a checkpoint holds tensors, numbers, str, bool, None and lists/dicts of these"
                    ),
                    run.state.step,
                ) from None
            plugin_states[name] = state
        data_state = self.feed.state_dict() if self.feed is not None else self._data_state
        _, blocked = self.checkpointer.save(
            {
                "plugins": plugin_states,
                "interval_log": self.log.pending(),
                **({"data": data_state} if data_state else {}),
            },
            evaluated=self._evaluated_now(),
        )
        self.last_saved_step = run.state.step
        self.log.times.add("checkpoint", blocked)
        run.control.checkpoint_requested = False
        if self.checkpointer.in_flight:
            log.info("checkpoint step %d: training blocked %.3f s; writing in the background", run.state.step, blocked)
        else:
            log.info("checkpoint step %d saved in %.3f s", run.state.step, blocked)
            self._saved(run.state.step)

    def _saved(self, step: int | None) -> None:
        if step is not None and self.hooks.on_checkpoint_saved:
            path = checkpoint.step_dir(checkpoint.checkpoint_root(self.run), step)
            self.hooks.on_checkpoint_saved(run=self.run, step=step, path=str(path))

    # ---------------------------------------------------------------- the loop

    def train(self) -> int:
        """Restore, train, save, validate; ``on_train_end`` for every plugin however it ends."""
        run, hooks = self.run, self.hooks
        run.started_at = time.monotonic()
        outcome = "error"
        try:
            with self.signals:
                self.restore()
                if self._signalled_during_start():
                    outcome = "signal"
                else:
                    if hooks.on_train_start:
                        hooks.on_train_start(run=run)
                    outcome = "completed" if run.config.train.skip_train else self._steps()
                    if outcome == "completed":  # an exit condition means "stop now", as in Megatron
                        self.save()  # the trained weights first: a failing validation cannot lose them
                        self._final_eval()
                    self._saved(self.checkpointer.wait())  # a save in flight finishes before we leave
                    self._mark_final_validation()
        except PluginError as exc:
            if exc.step is None:
                exc.step = run.state.step
            raise
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            if not is_out_of_memory(exc):
                raise
            raise RunFailure(out_of_memory(run, exc)) from exc
        finally:
            if outcome == "error" and self.checkpointer.in_flight:
                with contextlib.suppress(Exception):  # the error in hand is the one to report
                    self.checkpointer.wait()
            try:
                self._end(outcome)
            finally:
                if run.output_lock is not None:
                    run.output_lock.release()
        if outcome == "signal":
            return 128 + self.signum
        return run.control.exit_code if outcome == "stopped" else 0

    def _end(self, outcome: str) -> None:
        """on_train_end on every plugin, even past one that raises; the first failure is re-raised
        unless the run is already failing with another error."""
        run = self.run
        if not self.hooks.on_train_end:
            return
        errors = run.plugins.call_all("on_train_end", run=run, outcome=outcome)
        for error in errors:
            if isinstance(error, PluginError) and error.step is None:
                error.step = run.state.step
        if errors and outcome != "error":
            errors, first = errors[1:], errors[0]
        else:
            first = None
        for error in errors:  # the run already fails for another reason: say these too, then that one
            log.error("also: %s", error)
        if first is not None:
            raise first

    def _signalled_during_start(self) -> bool:
        """A signal that arrived while the run was being built and restored: stop before step one,
        agreed across ranks (nothing new to save)."""
        signum = self.signals.received or 0
        if self.run.dist.world_size > 1:
            signum = max_over_ranks(signum)[0]
        if signum:
            self.signum = signum
            log.info("stopping before the first step: received %s", signal.Signals(signum).name)
        return bool(signum)

    def _final_eval(self) -> None:
        """After training: validation (unless done at this step) and the test split, once each."""
        for split in ("valid", "test"):
            if self.evaluated_at.get(split) != self.run.state.step:
                self._eval(split)

    def _evaluated_now(self) -> list[str]:
        return sorted(split for split, step in self.evaluated_at.items() if step == self.run.state.step)

    def _mark_final_validation(self) -> None:
        """Tell the final checkpoint what was evaluated after it, so re-running a finished run adds no row."""
        run = self.run
        if run.dist.is_main and self.last_saved_step == run.state.step and run.config.checkpoint.save:
            checkpoint.mark_evaluated(
                checkpoint.step_dir(checkpoint.checkpoint_root(run), run.state.step), self._evaluated_now()
            )

    def _eval(self, split: str = "valid") -> None:
        """Evaluate ``split`` if it exists and evaluation is on; hand the metrics to on_eval."""
        run, train = self.run, self.run.config.train
        dataset = getattr(run.datasets, split)
        if dataset is None or not (train.eval_full or train.eval_iters):
            return
        if split not in self._evaluators:
            self._evaluators[split] = Evaluator(run, dataset, split)
        started = time.perf_counter()
        metrics = self._evaluators[split]()
        seconds = time.perf_counter() - started
        self.log.started += seconds  # evaluation time is not training time
        self.log.times.add("eval", seconds)
        self.evaluated_at[split] = run.state.step
        if self.hooks.on_eval:
            self.hooks.on_eval(run=run, step=run.state.step, metrics=metrics)

    def _steps(self) -> str:  # noqa: C901 - the loop reads best as one piece
        run, hooks, interval = self.run, self.hooks, self.log
        cfg = run.config.train
        model, optimizer, scheduler, control, state = run.model, run.optimizer, run.scheduler, run.control, run.state
        params = [p for p in model.parameters() if p.requires_grad]
        micro_size, world, clip = cfg.micro_batch_size, run.dist.world_size, cfg.clip_grad
        plan = StepPlan(self._micro_batches_deciding(), micro_size, world, state.step, state.consumed_samples)
        feed = self.feed = TrainBatches(run, plan, state.step + 1, self._data_state)
        loss_fn = run.loss_fn
        validate = bool((cfg.eval_iters or cfg.eval_full) and cfg.eval_interval and run.datasets.valid is not None)
        save_interval = run.config.checkpoint.save_interval
        # each rank's own deadline; agreeing on the max stop code makes the earliest-started rank's
        # deadline count for all, i.e. the start time is the minimum over ranks
        deadline = time.monotonic() + cfg.exit_duration_in_mins * 60 if cfg.exit_duration_in_mins else None
        check_exit = deadline is not None or cfg.exit_interval is not None or world > 1
        agree_skip = world > 1 and hooks.before_update is not None
        signals, checkpointer = self.signals, self.checkpointer
        plain = getattr(model, "no_sync", None) is None and run.config.run.precision == "fp32" and loss_fn is None
        sharded_norm = checkpoint.is_sharded(model)  # FSDP2: the grad norm is a DTensor
        scaler = run.grad_scaler
        interval.started = time.perf_counter()
        times, perf_counter = interval.times, time.perf_counter
        first_step = state.step + 1

        while state.step < cfg.train_iters:
            step = state.step + 1
            n_micro, consumed = plan.at(step)
            run.micro_batches_per_step = n_micro
            global_batch = micro_size * n_micro * world
            if hooks.pre_step:
                hooks.pre_step(run=run, step=step)

            started = perf_counter()
            batches = feed.step(step, n_micro, consumed)
            data_ready = perf_counter()
            events = times.events()
            if events is not None:
                events[0].record()
            values = None
            if n_micro == 1 and plain:  # the common case, with nothing a hand-written loop would not do
                batch = batches[0]
                loss = model(*batch) if type(batch) is tuple else outputs.call_model(model, batch)
                if type(loss) is not torch.Tensor:
                    loss, values = outputs.split_output(loss)
                loss.backward()
            else:
                loss, values = self._accumulate(batches)
            backward_done = perf_counter()
            if events is not None:
                events[1].record()

            if hooks.before_update:
                hooks.before_update(run=run, step=step, loss=loss.detach())
            grad_norm = None
            skipped = control.skip_reason is not None
            if agree_skip:  # one rank's veto is every rank's: replicas must take the same updates
                skipped = bool(max_over_ranks(int(skipped))[0])
            if skipped:
                state.skipped_updates += 1
                control.skip_reason = None
            elif scaler is not None:
                skipped, grad_norm = self._scaled_update(params, clip, global_batch)
            else:
                if clip > 0:
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
                    if sharded_norm:
                        grad_norm = grad_norm.full_tensor()
                optimizer.step()
                scheduler.step(global_batch)
            optimizer.zero_grad(set_to_none=True)
            if events is not None:
                events[2].record()
            times.step(started, data_ready, backward_done, perf_counter(), events)
            state.step = step
            state.consumed_samples += global_batch
            interval.add(loss, grad_norm, global_batch, values)
            if step == first_step and step % cfg.log_interval:
                interval.restart_clock()  # the first step warms up (compiles); rates leave it out
            if hooks.post_step:
                hooks.post_step(
                    run=run,
                    step=step,
                    outputs=StepOutputs(
                        loss=loss.detach(), grad_norm=grad_norm, skipped=skipped, global_batch_size=global_batch
                    ),
                )

            if step % cfg.log_interval == 0:
                metrics = interval.flush(run)
                self._say_if_input_bound(metrics)
                if hooks.on_log:
                    hooks.on_log(run=run, step=step, metrics=metrics)
            if validate and step % cfg.eval_interval == 0:
                self._eval("valid")

            if checkpointer.in_flight:
                self._saved(checkpointer.done())
            reason = None
            if check_exit or control.stop_reason is not None or signals.received is not None:
                reason = self._stop_reason(step, deadline)
            if reason == "signal" and hooks.on_signal:
                hooks.on_signal(run=run, signum=self.signum)
            if reason == "stopped":  # a plugin's stop says whether this state is worth saving
                save_now = control.checkpoint_requested
            else:
                save_now = bool(reason or control.checkpoint_requested or (save_interval and step % save_interval == 0))
            if save_now:
                self.save()
            if reason:
                log.info("stopping at step %d: %s", step, control.stop_reason or reason)
                return reason
        return "completed"

    def _scaled_update(
        self, params: list[torch.Tensor], clip: float, global_batch: int
    ) -> tuple[bool, torch.Tensor | None]:
        """fp16: unscale, clip, step unless gradients overflowed; (skipped, grad norm).

        Knowing whether to advance the schedule needs the overflow flag on the host: one sync
        per step, as Megatron's fp16 path has.
        """
        run, scaler = self.run, self.run.grad_scaler
        scaler.unscale_(run.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip) if clip > 0 else None
        scale = scaler.get_scale()
        scaler.step(run.optimizer)
        scaler.update()
        if scaler.get_scale() < scale:  # the scaler backs off exactly when it skipped the step
            run.state.skipped_updates += 1
            return True, None  # an overflowed norm would poison the interval's mean
        run.scheduler.step(global_batch)
        return False, grad_norm

    def _accumulate(self, batches: list[Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward over the micro-batches (DDP syncs only on the last);
        the mean loss and the mean of each named value the model returned."""
        run, model = self.run, self.run.model
        no_sync = getattr(model, "no_sync", None)  # DDP
        set_gradient_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2
        n_micro, losses, values = len(batches), [], []
        for i, batch in enumerate(batches):
            last = i == n_micro - 1
            if set_gradient_sync is not None:
                set_gradient_sync(last)
            sync = no_sync() if no_sync is not None and not last else contextlib.nullcontext()
            with sync, autocast(run):
                loss, named = outputs.call(model, batch, run.loss_fn)
            scaled = loss / n_micro if n_micro > 1 else loss
            (run.grad_scaler.scale(scaled) if run.grad_scaler is not None else scaled).backward()
            losses.append(loss.detach())
            values.append(named)
        if n_micro == 1:
            return losses[0], values[0]
        return torch.stack(losses).mean(), {
            name: torch.stack([v[name] for v in values]).float().mean() for name in values[0]
        }

    def _say_if_input_bound(self, metrics: dict[str, float]) -> None:
        """Once per run: most of a step waits for data, and which setting helps."""
        step_time = metrics.get("time/step", 0.0)
        if self._said_input_bound or step_time <= 0 or metrics["time/data_max"] < INPUT_BOUND_SHARE * step_time:
            return
        self._said_input_bound = True
        workers = self.run.config.data.num_workers
        hint = (
            "set data.num_workers (batches are read in the training loop now)"
            if workers == 0
            else f"raise data.num_workers (now {workers}) or data.prefetch_factor, or make the dataset's reads cheaper"
        )
        log.warning(
            "input-bound: %.0f%% of each step waits for data (%.1f ms of %.1f ms on the slowest rank); %s",
            100 * metrics["time/data_max"] / step_time,
            1e3 * metrics["time/data_max"],
            1e3 * step_time,
            hint,
        )

    def _micro_batches_deciding(self) -> Any:
        """Micro-batches for (step, consumed samples): a plugin's answer (rampup) or the configured."""
        run, hook, default = self.run, self.hooks.num_micro_batches, self.run.micro_batches_per_step
        if hook is None:
            return lambda step, consumed: default
        return lambda step, consumed: hook(run=run, step=step, consumed_samples=consumed) or default

    def _stop_reason(self, step: int, deadline: float | None) -> str | None:
        """Exit conditions, agreed across ranks so every rank stops at the same step."""
        cfg, control = self.run.config.train, self.run.control
        code, signum = 0, self.signals.received or 0
        if signum:
            code = 4
        elif control.stop_reason is not None:
            code = 3
        elif deadline is not None and time.monotonic() >= deadline:
            code = 2
        elif cfg.exit_interval and step % cfg.exit_interval == 0:
            code = 1
        if self.run.dist.world_size > 1:  # one exit code, and a checkpoint if any rank asks for one
            code, signum, exit_code, wants_checkpoint = max_over_ranks(
                code, signum, control.exit_code, int(control.checkpoint_requested)
            )
            control.exit_code, control.checkpoint_requested = exit_code, bool(wants_checkpoint)
        if code == 4:
            self.signum = signum
            control.request_stop(f"received {signal.Signals(signum).name}")
        elif code == 3 and control.stop_reason is None:
            control.request_stop("another rank requested a stop")
        return STOP_REASONS[code - 1] if code else None
