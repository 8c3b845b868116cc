"""``coretrain report RUN_DIR [RUN_DIR ...]``: runs' metrics.jsonl as PNG plots and a table.

For a person who would rather look than read: one PNG per quantity (loss with validation
loss, learning rate, grad and parameter norm, throughput, TFLOP/s and MFU, memory, where the
time of a step goes) against the step, in ``RUN_DIR/report/``, and a rich summary on the
terminal. Given several runs — "did my change help?" — every panel overlays them, labelled
by run name, loss is also drawn against samples (or tokens) and against wall time, and the
table has a column per run and the differences of their final values (written to the first
run's ``report/compare/``). A run still going is read as far as it got. Needs matplotlib
(``pip install 'coretrain-plugins[report]'``); it is imported only by this command.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from coretrain import UserError, require
from coretrain_report.summary import FINALS, evaluated_finals, final, series, summary

log = logging.getLogger("coretrain")

Rows = list[dict[str, Any]]

PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    # (file stem, y-axis label, [(metric, legend label), ...]); a panel with no data is left out
    ("loss", "loss", [("loss", "train (mean of interval)"), ("valid/loss", "validation")]),
    ("lr", "learning rate", [("lr", "lr")]),
    ("weight_decay", "weight decay", [("weight_decay", "scheduled (start_weight_decay to end)")]),
    ("grad_norm", "L2 norm", [("grad_norm", "gradients (before clipping)")]),
    ("params_norm", "L2 norm", [("params_norm", "parameters")]),
    (
        "throughput",
        "per device",
        [("tokens_per_second_per_device", "tokens/s"), ("samples_per_second_per_device", "samples/s")],
    ),
    ("tflops", "TFLOP/s per device", [("tflops_per_device", "model TFLOP/s")]),
    ("memory", "GB", []),  # every memory/*_gb metric the run logged
    (
        "time",
        "seconds per step",
        [
            ("time/data", "waiting for data"),
            ("time/forward_backward", "forward + backward"),
            ("time/optimizer", "optimizer step"),
            ("time/step", "whole step"),
        ],
    ),
]
COMPARE_PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    # (file stem, x metric, x label, lines): loss against data seen and against wall time
    ("loss_vs_samples", "consumed_samples", "samples", [("loss", "train"), ("valid/loss", "validation")]),
    ("loss_vs_time", "elapsed_seconds", "wall time (s)", [("loss", "train"), ("valid/loss", "validation")]),
]


def read_metrics(path: Path) -> Rows:
    """The rows of a metrics.jsonl, numbers only. A line that is not a metrics row (torn by a
    crash or a full disk, binary, edited by hand) is skipped with one warning naming the first;
    only a file with no row at all is an error."""
    if not path.is_file():
        raise UserError(f"{path}: no such file; give the run's output dir (it holds metrics.jsonl), or --metrics FILE")
    rows, skipped = [], []
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
    for number, line in enumerate(lines, start=1):
        if line.strip():
            row = _metrics_row(line)
            if row is None:
                skipped.append(number)
            else:
                rows.append(row)
    if skipped and not (skipped == [len(lines)] and not path.read_bytes().endswith(b"\n")):  # not a line being written
        first = lines[skipped[0] - 1][:60]
        log.warning(
            "%s: skipped %d line(s) that are not metrics rows, first %d: %r", path, len(skipped), skipped[0], first
        )
    if not rows:
        raise UserError(f"{path}: no metrics yet (the run logs every train.log_interval steps)")
    return rows


def _metrics_row(line: str) -> dict[str, float] | None:
    """A JSON object with an integer 'step', keeping its numeric values; None for anything else."""
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(row, dict) or type(row.get("step")) is not int:
        return None
    return {key: value for key, value in row.items() if type(value) in (int, float)}


def plot(runs: list[tuple[str, Rows]], out_dir: Path, title: str) -> list[Path]:
    """One PNG per panel that has data, each run's curves overlaid; returns the files written."""
    matplotlib = require("matplotlib", needed_by="coretrain report", extra="report")
    matplotlib.use("Agg")  # files only: no display needed (or wanted) on a cluster node
    import matplotlib.pyplot as plt

    several = len(runs) > 1
    memory = sorted(
        {k for _, rows in runs for row in rows for k in row if k.startswith("memory/") and k.endswith("_gb")}
    )
    set_losses = sorted(
        {k for _, rows in runs for row in rows for k in row if k.startswith("valid/") and k.endswith("/loss")}
        - {"valid/loss"}
    )
    panels = [(stem, "step", "step", ylabel, lines) for stem, ylabel, lines in PANELS]
    if several:
        panels += [(stem, x, xlabel, "loss", lines) for stem, x, xlabel, lines in COMPARE_PANELS]
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, x, xlabel, ylabel, lines in panels:
        if stem == "memory":
            lines = [(name, name.removeprefix("memory/").removesuffix("_gb")) for name in memory]
        if stem.startswith("loss"):  # each named validation set's loss too (valid/NAME/loss)
            lines = lines + [(name, name.removesuffix("/loss")) for name in set_losses]
        drawn = []
        for run_name, rows in runs:
            curves = [(label, *series(rows, name, x)) for name, label in lines]
            curves = [(f"{run_name}: {label}" if several else label, xs, ys) for label, xs, ys in curves if xs]
            if stem == "throughput":
                curves = curves[:1]  # tokens/s when the data has tokens, else samples/s: one scale
            drawn += curves
        if not drawn:
            continue
        figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
        for label, xs, ys in drawn:
            axes.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
        if stem == "tflops" and not several:
            _mfu_axis(axes, runs[0][1])
        if stem in ("memory", "time"):
            axes.set_ylim(bottom=0)  # amounts: the scale starts at nothing
        axes.set(xlabel=xlabel, ylabel=ylabel, title=f"{title}: {stem.replace('_', ' ')}")
        axes.grid(alpha=0.3)
        axes.legend(loc="best", fontsize="small")
        figure.tight_layout()
        path = out_dir / f"{stem}.png"
        figure.savefig(path)
        plt.close(figure)
        written.append(path)
    return written


def _mfu_axis(axes: Any, rows: Rows) -> None:
    """MFU on a right-hand axis: the same curve in units of the device's peak."""
    tflops = [row["tflops_per_device"] / row["mfu"] for row in rows if row.get("mfu") and row.get("tflops_per_device")]
    if tflops:
        peak = tflops[0]
        right = axes.secondary_yaxis("right", functions=(lambda t: 100 * t / peak, lambda m: m * peak / 100))
        right.set_ylabel(f"MFU % (peak {peak:g} TFLOP/s)")


def runs_in(directory: Path) -> list[Path]:
    """A run's directory, or a directory of runs (``coretrain sweep``'s): the runs in it."""
    if (directory / "metrics.jsonl").exists() or not directory.is_dir():
        return [directory]
    inner = sorted(path for path in directory.iterdir() if (path / "metrics.jsonl").is_file())
    return inner or [directory]


def report(run_dirs: list[Path], metrics_file: Path | None = None, out_dir: Path | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    if metrics_file is not None and len(run_dirs) > 1:
        raise UserError("--metrics reads one file; give one run, or drop --metrics to compare runs")
    if metrics_file is None:
        expanded = [run for run_dir in run_dirs for run in runs_in(run_dir)]
        if len(run_dirs) == 1 and expanded != run_dirs:  # a sweep's directory: its report beside its runs
            out_dir = out_dir or run_dirs[0] / "report"
        run_dirs = expanded
    names = [run_dir.resolve().name for run_dir in run_dirs]
    runs = [(name, read_metrics(metrics_file or run_dir / "metrics.jsonl")) for name, run_dir in zip(names, run_dirs)]
    console = Console(highlight=False)
    if len(runs) == 1:
        written = plot(runs, out_dir or run_dirs[0] / "report", names[0])
        table = Table(title=f"run {run_dirs[0]}", show_header=False, title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for what, value in summary(runs[0][1]):
            table.add_row(what, value)
    else:
        written = plot(runs, out_dir or run_dirs[0] / "report" / "compare", " vs ".join(names))
        table = Table(title=f"{len(runs)} runs", title_justify="left")
        table.add_column("", style="bold")
        for name in names:
            table.add_column(name, justify="right")
        table.add_column(f"{names[-1]} − {names[0]}", justify="right")
        for what, how, fmt in FINALS + evaluated_finals([rows for _, rows in runs]):
            values = [final(rows, how) for _, rows in runs]
            if all(v is None for v in values):
                continue
            cells = [fmt.format(v) if v is not None else "-" for v in values]
            first, last = values[0], values[-1]
            difference = (
                "-"
                if first is None or last is None
                else f"{last - first:+.4g}" + (f" ({(last - first) / abs(first):+.1%})" if first else "")
            )
            table.add_row(what, *cells, difference)
    console.print(table)
    for path in written:
        console.print(f"wrote {path}", soft_wrap=True)
    return 0
