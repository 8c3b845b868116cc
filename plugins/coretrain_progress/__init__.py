"""``progress``: what a person watching the run sees (rank 0 only).

On a terminal, a rich Live panel: a progress bar that moves with every step (the panel is
redrawn four times a second from the run's step counter, so no per-step hook), elapsed time,
steps/s and an ETA from the first step, loss, learning rate, throughput, the share of a step
spent waiting for data, the last validation and the last few events. The panel keeps one
width and a fixed number of event lines, and while it is up every log line (the core's, a
library's) is printed above it through rich, so nothing written to the terminal can leave a
stale copy of it behind. In Jupyter, the same panel as a notebook output (rich's notebook
support, with ipywidgets; the Python API, ``coretrain.train``). When stdout is neither (CI,
``| tee``, a job log) or the notebook has no ipywidgets, one plain line per log interval
instead. Above ``run.log_level = "info"`` (``--quiet``) it stays silent.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections import deque
from datetime import timedelta
from typing import Any

from attrs import define, field
from coretrain_wholemodel import WholeModel

from coretrain import Outcome, Run, hookimpl, non_negative

EVENT_LINES = 5
"""The live panel's event lines: a fixed height, so the panel never jumps."""


CENTURY = 100 * 365 * 24 * 3600


def to_log_files(text: str) -> None:
    """A line for the run's log files (``run.log``: a file handler on the root logger) and not
    the console, which shows it its own way (the live panel, or the printed line)."""
    record = logging.LogRecord("coretrain.progress", logging.INFO, __file__, 0, text, None, None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def eta(seconds: float) -> str:
    """A duration as H:MM:SS (days before it when longer); past a century (or not a number),
    said so: a run planned that long would overflow what a timedelta holds."""
    if not seconds < CENTURY:
        return "over 100 years"
    return str(timedelta(seconds=int(max(seconds, 0))))


def data_share(metrics: dict[str, float]) -> str:
    """The share of a step spent waiting for data, e.g. "data 41%"."""
    step = metrics.get("time/step", 0.0)
    return f"data {100 * metrics.get('time/data', 0.0) / step:.0f}%" if step > 0 else "data -"


def experts(metrics: dict[str, float]) -> str:
    """A mixture of experts' load over its layers and its load-balancing loss, e.g. "experts
    load 9%–41%, aux 0.0102" (the smallest and largest share of assignments any expert took);
    "" for a model without experts."""
    lows = [value for name, value in metrics.items() if name.startswith("train/moe/") and name.endswith("/load_min")]
    highs = [value for name, value in metrics.items() if name.startswith("train/moe/") and name.endswith("/load_max")]
    if not lows or not highs:
        return ""
    aux = f", aux {metrics['train/moe_aux_loss']:.4g}" if "train/moe_aux_loss" in metrics else ""
    return f"experts load {min(lows):.0%}–{max(highs):.0%}{aux}"


def in_notebook() -> bool:
    """Jupyter (or Colab) with ipywidgets: rich draws its live view there as a notebook output.
    Without ipywidgets rich can only warn that it needs them, so the notebook gets plain lines."""
    from rich.console import Console

    if not Console().is_jupyter:
        return False
    try:
        import ipywidgets  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return False
    return True


def valid_losses(metrics: dict[str, float]) -> str:
    """ "valid loss 2.1", or one loss per named validation set ("valid/wiki 2.1  valid/code 2.3")."""
    if "valid/loss" in metrics:
        return f"valid loss {metrics['valid/loss']:.4f}"
    named = [f"{name[: -len('/loss')]} {value:.4f}" for name, value in metrics.items() if name.endswith("/loss")]
    return "  ".join(named) or "valid -"


@define(kw_only=True)
class Progress:
    """Live progress view on a terminal; one line per log interval otherwise."""

    plain: bool | None = None
    """Force plain lines (true) or the live view (false); unset = live on a terminal or in Jupyter."""
    events: int = field(default=5, validator=non_negative)
    """How many recent events the live view shows."""
    _live: Any = field(default=None, init=False, repr=False)
    _bar: Any = field(default=None, init=False, repr=False)
    _task: Any = field(default=None, init=False, repr=False)
    _metrics: dict[str, float] = field(factory=dict, init=False, repr=False)
    _eval: dict[str, float] = field(factory=dict, init=False, repr=False)
    _events: deque[str] = field(factory=lambda: deque(maxlen=EVENT_LINES), init=False, repr=False)
    _active: bool = field(default=False, init=False, repr=False)
    _started: float = field(default=0.0, init=False, repr=False)
    _total: int = field(default=0, init=False, repr=False)
    _run: Run | None = field(default=None, init=False, repr=False)
    _first_step: int = field(default=0, init=False, repr=False)
    _streams: dict[Any, Any] = field(factory=dict, init=False, repr=False)

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        parameters = WholeModel(run).numel  # every rank: the whole model's, gathered from its parts
        self._active = run.dist.is_main and logging.getLogger("coretrain").isEnabledFor(logging.INFO)
        if not self._active:
            return
        self._run = run
        self._total = run.train_iters
        self._started = time.perf_counter()
        self._first_step = run.state.step
        if not (self.plain if self.plain is not None else not (sys.stdout.isatty() or in_notebook())):
            import shutil

            from rich.live import Live
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
            from rich.progress import Progress as Bar

            rows = shutil.get_terminal_size().lines
            self._events = deque(maxlen=max(1, min(self.events, rows - 8)))  # the panel always fits
            self._bar = Bar(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), expand=True)
            self._task = self._bar.add_task("train", total=self._total, completed=run.state.step)
            terminal = (sys.__stderr__, sys.__stdout__, sys.stderr)  # (sys.stderr: console-log's copy of the terminal)
            self._live = Live(self, refresh_per_second=4, transient=False, redirect_stdout=True, redirect_stderr=True)
            self._live.start()
            self._log_above(True, terminal)
        else:
            self._events = deque(maxlen=self.events)
        self._event(start_line(run, parameters))
        if run.state.step:
            self._event(f"resumed at step {run.state.step}")

    def _log_above(self, on: bool, terminal: tuple[Any, ...] = ()) -> None:
        """While the panel is up, log handlers writing to the terminal (``terminal``: its streams
        as the panel started) write through rich's proxy, which prints above the live region
        instead of over it."""
        handlers = [
            h
            for h in logging.getLogger().handlers + logging.getLogger("coretrain").handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
        ]
        for handler in handlers:
            if on and handler.stream in terminal:
                self._streams[handler] = handler.setStream(sys.stderr)
            elif not on and handler in self._streams:
                handler.setStream(self._streams.pop(handler))

    def _event(self, text: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        self._events.append(f"{stamp} {text}")
        if self._live is None and self._active:
            print(f"[{stamp}] {text}", flush=True)

    def __rich__(self) -> Any:
        """The panel, drawn by rich's refresh thread from the run's current step."""
        from rich.console import Group
        from rich.panel import Panel
        from rich.table import Table

        step = self._run.state.step if self._run is not None else 0
        self._bar.update(self._task, completed=step)
        elapsed = time.perf_counter() - self._started
        done = step - self._first_step
        rate = done / elapsed if elapsed > 0 and done else 0.0
        timing = f"elapsed {eta(elapsed)}   {rate:,.1f} steps/s   ETA " + (
            eta((self._total - step) / rate) if rate else "-"
        )
        table = Table.grid(padding=(0, 3))
        m = self._metrics
        cells = [
            f"loss [bold]{m['loss']:.4f}[/]" if "loss" in m else "loss -",
            f"lr {m['lr']:.2e}" if "lr" in m else "lr -",
            f"{m['tokens_per_second']:,.0f} tok/s"
            if "tokens_per_second" in m
            else (f"{m['samples_per_second']:,.1f} samples/s" if "samples_per_second" in m else ""),
            data_share(m) if m else "data -",
            valid_losses(self._eval),
            *([load] if (load := experts(m)) else []),
        ]
        table.add_row(*cells)
        lines = list(self._events) + [""] * (EVENT_LINES - len(self._events))  # a fixed height
        return Panel(Group(self._bar, timing, table, f"[dim]{chr(10).join(lines)}[/]"), title="coretrain", expand=True)

    @hookimpl
    def on_log(self, run: Run, step: int, metrics: dict[str, float]) -> None:
        if not self._active or run.config.train.skip_train_metrics_log:
            return
        self._metrics = metrics
        remaining = (self._total - step) * metrics.get("iteration_time", 0.0)
        rate = (
            f"{metrics['tokens_per_second']:,.0f} tok/s"
            if "tokens_per_second" in metrics
            else f"{metrics.get('samples_per_second', 0.0):,.1f} samples/s"
        )
        lr = f"lr {metrics['lr']:.3e} | " if "lr" in metrics else ""  # no schedule plugin: no lr
        load = f" | {load}" if (load := experts(metrics)) else ""
        line = (
            f"step {step:>{len(str(self._total))}}/{self._total} | loss {metrics.get('loss', math.nan):.4f} | "
            f"{lr}{rate} | {data_share(metrics)}{load} | ETA {eta(remaining)}"
        )
        to_log_files(line)  # as Megatron's log has its training lines, whatever the console shows
        if self._live is None:
            print(line, flush=True)

    @hookimpl
    def on_eval(self, step: int, metrics: dict[str, float]) -> None:
        if not self._active:
            return
        split = next(iter(metrics)).split("/")[0] if metrics else "valid"
        values = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"{split}/")}
        if split == "valid":
            self._eval = metrics
        text = f"step {step}: {split}"
        text += f" loss {values['loss']:.4f}" if "loss" in values else ""
        text += f" (ppl {values['ppl']:.2f})" if "ppl" in values else ""
        rest = [f"{name} {value:.4g}" for name, value in values.items() if name not in ("loss", "ppl")]
        text += (", " if "loss" in values else " ") + ", ".join(rest) if rest else ""
        self._event(text)

    @hookimpl
    def on_train_end(self, run: Run, outcome: Outcome) -> None:
        if self._active:
            elapsed = time.perf_counter() - self._started
            loss = f", last logged loss {self._metrics['loss']:.4f}" if "loss" in self._metrics else ""
            when = "after" if outcome == "error" else "at"  # a failure is in the step after the last one done
            self._event(f"{outcome} {when} step {run.state.step} in {eta(elapsed)}{loss}")
        if self._live is not None:
            self._live.stop()  # (its last frame shows the run: let go of it only after)
            self._live = None
            self._log_above(False)
        self._run = None  # an in-process restart builds a new run: this one must be free to go


def start_line(run: Run, params: int) -> str:
    """What a run is about to do, in one line: size (``params``: the whole model's), batch (and
    how it is made), ranks, device, precision and threads — what decides its speed, said before
    the first step."""
    import torch

    micro, accumulation = run.config.train.micro_batch_size, run.micro_batches_per_step
    return (
        f"{run.config.run.name}: {parameter_count(params)} parameters, global batch {run.global_batch_size} "
        f"(micro {micro} × {accumulation} accumulation × {run.dist.dp_size} data-parallel), "
        f"{run.dist.world_size} rank(s) on {run.device.type}, {run.config.run.precision}, "
        f"{torch.get_num_threads()} thread(s)"
    )


def parameter_count(params: int) -> str:
    """A model's size as a person reads it: 161, 48,513, 0.84M, 1.24B (a small model is not "0.00M")."""
    if params < 100_000:
        return f"{params:,}"
    return f"{params / 1e6:.2f}M" if params < 1_000_000_000 else f"{params / 1e9:.2f}B"
