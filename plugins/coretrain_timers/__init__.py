"""``timers`` (on by default): where a step's time goes and what it achieves, as Megatron's
training_log: phase times, throughput per device, FLOPs, TFLOP/s, MFU and memory.

``time/data``, ``time/forward_backward``, ``time/optimizer``: seconds per step over the log
interval; ``time/eval``, ``time/checkpoint``: seconds spent on them in the interval. Each is
the slowest rank's (Megatron's timers report the maximum; ``time/data_max`` is the same value
under its older name), agreed with one tiny CPU all-reduce per log interval, never a device
sync. Measured from the loop's phase marks (hook ``phase_listener``): host clocks at the
boundaries; on CUDA, forward + backward and the optimizer step with CUDA events, read at the
log step once the interval's own sync has completed them, so they are the GPU's time, not
the time to launch kernels. The data wait is host time everywhere: it is the host that waits.
The first step (compilation, warm caches) is left out unless it is a log step. A run whose
slowest rank waits ``input_bound_share`` of a step for data is told so, once, with the
setting that helps.

Megatron's switches: ``timing_log_level`` 0 logs the step time alone (no phase clocks), 1 the
phases (the default here), 2 the phases with every rank lined up at each phase boundary (a
device sync and a CPU barrier per mark, so a phase's time is that phase's on every rank, not a
wait for a slower one; costs a few collectives per step); ``timing_log_option`` "max" (the
slowest rank), "minmax" (also ``time/PHASE_min``) or "all" (also ``time/PHASE/rankN``);
``time_unit`` "s" or "ms" for the ``time/*`` values; ``memory_keys`` picks and names the memory
statistics (torch.cuda.memory_stats keys; on CPU ``rss_bytes.current``/``rss_bytes.peak``).

The rates, over the interval's training time (its evaluations left out, the first step too
unless it is a log step): ``iteration_time`` (= ``time/step``), ``samples_per_second``,
``batches_per_second`` (optimizer steps), ``tokens_per_second`` (when the datasets declare a
``seq_length``), ``time/total`` (the interval's wall time, evaluations and saves included); from them and
``run.flops_per_sample``: ``samples_per_second_per_device``, ``tokens_per_second_per_device``,
``consumed_tokens``, ``tflops_per_device``, ``mfu`` (against ``peak_tflops`` or the GPU's entry
in a table of dense bf16 peaks), ``elapsed_seconds`` and ``remaining_seconds``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from time import perf_counter
from typing import Any, Literal

import torch
from attrs import define, field

from coretrain import Run, fraction, hookimpl, max_over_ranks, positive
from coretrain_timers.flops import flops_per_sample
from coretrain_timers.memory import memory, selected_memory

log = logging.getLogger("coretrain")

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}
"""Dense bf16 tensor-core peaks per device (vendor datasheets), matched by substring of the name."""

STEP_PHASES = ("data", "forward_backward", "optimizer")
INTERVAL_PHASES = ("eval", "checkpoint")


class PhaseTimes:
    """Seconds per phase since the last log, from the loop's marks (one clock read per mark)."""

    def __init__(self, run: Run, line_up: bool = False) -> None:
        self.run = run
        self.cuda = run.device.type == "cuda"
        self.line_up = line_up and run.dist.world_size > 1
        """timing_log_level 2: every rank waits for the others at each mark (a CPU barrier)."""
        self.seconds = dict.fromkeys(STEP_PHASES + INTERVAL_PHASES, 0.0)
        self.steps = 0
        self.reset_at = -1
        """The step whose start leaves everything before out (the first step's warm-up)."""
        self._events: list[tuple[Any, Any, Any]] = []
        self._pending: tuple[Any, Any, Any] = (None, None, None)
        self._since = perf_counter()
        self._open: str | None = None
        self._open_since = 0.0
        self.reset()

    def reset(self) -> None:
        """The interval starts now, at the run's present step and samples."""
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        self.steps = 0
        self._events.clear()
        self.started, self.from_step = perf_counter(), self.run.state.step
        self.computed = 0
        """Samples of the interval's steps that ran (a step skipped before it ran draws its batch
        and computes nothing: its samples count toward no rate, FLOPs or MFU)."""

    def rates(self) -> dict[str, float]:
        """Seconds per step and samples (tokens) per second since :meth:`reset`, its evaluations
        left out (call before :meth:`collect`, which starts the next interval)."""
        elapsed = perf_counter() - self.started - self.seconds["eval"]
        steps = self.run.state.step - self.from_step
        per_second = self.computed / elapsed if steps and elapsed > 0 else 0.0
        rates = {"iteration_time": elapsed / steps if steps else 0.0, "samples_per_second": per_second}
        rates["batches_per_second"] = steps / elapsed if steps and elapsed > 0 else 0.0
        rates["time/total"] = perf_counter() - self.started
        if self.run.datasets.seq_length:
            rates["tokens_per_second"] = per_second * self.run.datasets.seq_length
        if rates["iteration_time"] > 0:
            rates["time/step"] = rates["iteration_time"]
        return rates

    def mark(self, step: int, phase: str) -> None:
        """The phase listener: one comparison chain, no further call (it runs at every mark)."""
        if self.line_up:
            if self.cuda:
                torch.cuda.synchronize(self.run.device)
            max_over_ranks(0)  # a barrier: the phase starts on every rank at once
        now = perf_counter()
        if self._open is not None:  # an evaluation or a checkpoint ends at the next mark
            self.seconds[self._open] += now - self._open_since
            self._open = None
        if phase == "data":
            if step == self.reset_at:
                self.reset()
            self._since = now
        elif phase == "forward_backward":
            self.seconds["data"] += now - self._since
            self._since = now
            self.computed += self.run.global_batch_size
            if self.cuda:
                self._pending = _new_events()
                self._pending[0].record()
        elif phase == "update":
            if self.cuda:
                self._pending[1].record()
            else:
                self.seconds["forward_backward"] += now - self._since
                self._since = now
        elif phase == "post_step":
            self.steps += 1
            if self.cuda:
                self._pending[2].record()
                self._events.append(self._pending)
            else:
                self.seconds["optimizer"] += now - self._since
        elif phase == "eval" or phase == "checkpoint":
            self._open, self._open_since = phase, now

    def collect(self) -> dict[str, float]:
        """``time/PHASE`` on this rank: seconds per step for step phases, in the interval for the others."""
        if self._events:
            self._events[-1][2].synchronize()  # the log step synced already: the last event is done
        for start, backward_end, update_end in self._events:
            self.seconds["forward_backward"] += start.elapsed_time(backward_end) / 1000
            self.seconds["optimizer"] += backward_end.elapsed_time(update_end) / 1000
        steps = self.steps
        metrics = {f"time/{p}": self.seconds[p] / steps if steps else 0.0 for p in STEP_PHASES}
        metrics.update({f"time/{p}": self.seconds[p] for p in INTERVAL_PHASES})
        self.reset()
        return metrics


def _new_events() -> tuple[Any, Any, Any]:
    new = torch.cuda.Event
    return new(enable_timing=True), new(enable_timing=True), new(enable_timing=True)  # type: ignore[no-untyped-call]


def _every_rank(run: Run, mine: dict[str, float], micros: list[int]) -> dict[str, float]:
    """Every rank's phase times, the slowest under the plain name: one all-reduce (a maximum) of
    a row per rank, each rank filling its own row and zeros elsewhere."""
    world, rank, phases = run.dist.world_size, run.dist.rank, len(mine)
    rows = [micros if r == rank else [0] * phases for r in range(world)]
    flat = max_over_ranks(*(value for row in rows for value in row))
    metrics: dict[str, float] = {}
    for index, name in enumerate(mine):
        seconds = [flat[r * phases + index] / 1e6 for r in range(world)]
        metrics[name] = max(seconds)
        metrics.update({f"{name}/rank{r}": value for r, value in enumerate(seconds)})
    return metrics


def peak_tflops(run: Run, configured: float | None) -> float | None:
    """``plugins.timers.peak_tflops`` if set, else the table's entry for this GPU, else unknown."""
    if configured:
        return configured
    if run.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(run.device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def throughput(
    run: Run, samples_per_second: float, iteration_time: float, elapsed: float, peak: float | None
) -> dict[str, float]:
    """Tokens, FLOPs and MFU per device, consumed tokens, elapsed and estimated remaining time."""
    world = run.dist.world_size
    metrics = {
        "samples_per_second_per_device": samples_per_second / world,
        "elapsed_seconds": elapsed,
        "remaining_seconds": max(run.train_iters - run.state.step, 0) * iteration_time,
    }
    if run.flops_per_sample:
        tflops = samples_per_second * run.flops_per_sample / world / 1e12
        metrics["tflops_per_device"] = tflops
        if peak:
            metrics["mfu"] = tflops / peak
    seq_length = run.datasets.seq_length
    if seq_length:
        metrics["tokens_per_second_per_device"] = samples_per_second * seq_length / world
        metrics["consumed_tokens"] = float(run.state.consumed_samples * seq_length)
    return metrics


@define(kw_only=True)
class Timers:
    """Where a step's time goes (time/*), throughput per device, TFLOP/s and MFU."""

    input_bound_share: float = field(default=0.3, validator=fraction)
    """Warn once when the slowest rank waits this share of a step for data (0 = never)."""
    peak_tflops: float | None = field(default=None, validator=positive)
    """Peak TFLOP/s of one device, for MFU; unset = a table of known GPUs (was run.peak_tflops)."""
    timing_log_level: Literal[0, 1, 2] = 1
    """Megatron's: 0 the step time only, 1 each phase's time, 2 each phase's with the ranks lined up."""
    timing_log_option: Literal["max", "minmax", "all"] = "max"
    """Megatron's: the slowest rank's phase times, also the fastest's (``_min``), or every rank's."""
    time_unit: Literal["s", "ms"] = "s"
    """The unit of the ``time/*`` values."""
    memory_keys: dict[str, str] | None = None
    """Memory statistic -> metric name (Megatron-Bridge's); unset: the default set in GB."""
    _times: PhaseTimes | None = field(default=None, init=False, repr=False)
    _said: bool = field(default=False, init=False, repr=False)

    @hookimpl(wrapper=True)
    def configure_model(self, run: Run) -> Generator[None, None, None]:
        """Count the FLOPs on the plain model, before any configure_model converts or wraps it."""
        run.flops_per_sample = flops_per_sample(run)
        return (yield)

    @hookimpl
    def phase_listener(self, run: Run) -> Callable[[int, str], None]:
        self._times = PhaseTimes(run, line_up=self.timing_log_level == 2)
        return self._times.mark

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        assert self._times is not None  # phase_listener is asked first
        if self.memory_keys is not None:
            selected_memory(run.device, self.memory_keys)  # a key this device has not: one error now
        self._times.reset()  # restored from a checkpoint: the interval counts from here
        first = run.state.step + 1
        if not run.cadence.logs(first):
            self._times.reset_at = first + 1  # the first step warms up (compiles): leave it out

    @hookimpl
    def on_train_end(self) -> None:
        """The run is over: its timings (which hold it) go, so an in-process restart can free it."""
        self._times = None

    @hookimpl(tryfirst=True)  # before the progress view and the backends, which show these
    def on_log(self, run: Run, metrics: dict[str, float]) -> None:
        assert self._times is not None
        rates = self._times.rates()
        metrics.update(rates)
        elapsed = time.monotonic() - run.started_at
        peak = peak_tflops(run, self.peak_tflops)
        metrics.update(throughput(run, rates["samples_per_second"], rates["iteration_time"], elapsed, peak))
        metrics.update(
            memory(run.device) if self.memory_keys is None else selected_memory(run.device, self.memory_keys)
        )
        mine = self._times.collect()
        if self.timing_log_level:
            metrics.update(self._over_ranks(run, mine))
            metrics["time/data_max"] = metrics["time/data"]
            self._say_if_input_bound(run, metrics)
        if self.time_unit == "ms":
            metrics.update({name: value * 1e3 for name, value in metrics.items() if name.startswith("time/")})

    def _over_ranks(self, run: Run, mine: dict[str, float]) -> dict[str, float]:
        """The phase times as ``timing_log_option`` asks: one CPU all-reduce of microseconds (no
        device sync), two values per phase for "minmax" (the minimum as a negated maximum)."""
        micros = [round(seconds * 1e6) for seconds in mine.values()]
        if self.timing_log_option == "all":
            return _every_rank(run, mine, micros)
        if self.timing_log_option == "minmax":
            both = max_over_ranks(*micros, *(-value for value in micros))
            slowest = {name: value / 1e6 for name, value in zip(mine, both)}
            return slowest | {f"{name}_min": -value / 1e6 for name, value in zip(mine, both[len(mine) :])}
        return {name: value / 1e6 for name, value in zip(mine, max_over_ranks(*micros))}  # CPU, no device sync

    def _say_if_input_bound(self, run: Run, metrics: dict[str, float]) -> None:
        """One warning for the job, by rank 0: the data time is the slowest rank's already."""
        step_time, data = metrics.get("time/step", 0.0), metrics["time/data"]
        silent = self._said or not run.dist.is_main or not self.input_bound_share  # said, rank 0's to say, or off
        if silent or step_time <= 0 or data < self.input_bound_share * step_time:
            return
        self._said = True
        workers = run.config.data.num_workers
        hint = (
            "set data.num_workers (batches are read in the training loop now)"
            if workers == 0
            else f"raise data.num_workers (now {workers}) or data.prefetch_factor, or make the dataset's reads cheaper"
        )
        log.warning(
            "input-bound: %.0f%% of each step waits for data (%.1f ms of %.1f ms on the slowest rank); %s",
            100 * data / step_time,
            1e3 * data,
            1e3 * step_time,
            hint,
        )
