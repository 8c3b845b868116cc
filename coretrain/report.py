"""``coretrain report RUN_DIR``: a finished (or running) run's metrics.jsonl as PNG plots and a table.

For a person who would rather look than read: one PNG per quantity (loss with validation
loss, learning rate, grad and parameter norm, throughput, TFLOP/s and MFU, memory) against the step, in
``RUN_DIR/report/``, and a rich summary on the terminal. Needs matplotlib
(``pip install 'coretrain[report]'``); it is imported only by this command.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from coretrain.errors import UserError, require

Rows = list[dict[str, Any]]

PANELS: list[tuple[str, str, list[tuple[str, str]]]] = [
    # (file stem, y-axis label, [(metric, legend label), ...]); a panel with no data is left out
    ("loss", "loss", [("loss", "train (mean of interval)"), ("valid/loss", "validation")]),
    ("lr", "learning rate", [("lr", "lr")]),
    ("grad_norm", "L2 norm", [("grad_norm", "gradients (before clipping)")]),
    ("params_norm", "L2 norm", [("params_norm", "parameters")]),
    ("throughput", "per device", [("tokens_per_second_per_device", "tokens/s"),
                                  ("samples_per_second_per_device", "samples/s")]),
    ("tflops", "TFLOP/s per device", [("tflops_per_device", "model TFLOP/s")]),
    ("memory", "GB", []),  # every memory/*_gb metric the run logged
]


def read_metrics(path: Path) -> Rows:
    """The rows of a metrics.jsonl; a line that is not JSON is a UserError naming file and line."""
    if not path.is_file():
        raise UserError(f"{path}: no such file; give the run's output dir (it holds metrics.jsonl), "
                        "or --metrics FILE")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}:{number}: not a JSON object ({exc.msg}); was the file edited by hand?") from None
        if not isinstance(row, dict) or "step" not in row:
            raise UserError(f"{path}:{number}: expected an object with a 'step', got {line[:60]!r}")
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: no metrics yet (the run logs every train.log_interval steps)")
    return rows


def series(rows: Rows, name: str) -> tuple[list[int], list[float]]:
    points = [(row["step"], row[name]) for row in rows if isinstance(row.get(name), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


def plot(rows: Rows, out_dir: Path, title: str) -> list[Path]:
    """One PNG per panel that has data; returns the files written."""
    matplotlib = require("matplotlib", needed_by="coretrain report", extra="report")
    matplotlib.use("Agg")  # files only: no display needed (or wanted) on a cluster node
    import matplotlib.pyplot as plt

    memory = sorted({k for row in rows for k in row if k.startswith("memory/") and k.endswith("_gb")})
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, ylabel, lines in PANELS:
        if stem == "memory":
            lines = [(name, name.removeprefix("memory/").removesuffix("_gb")) for name in memory]
        drawn = [(label, *series(rows, name)) for name, label in lines]
        drawn = [(label, steps, values) for label, steps, values in drawn if steps]
        if stem == "throughput":
            drawn = drawn[:1]  # tokens/s when the data has tokens, else samples/s: one scale
        if not drawn:
            continue
        figure, axes = plt.subplots(figsize=(7, 4), dpi=100)
        for label, steps, values in drawn:
            axes.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
        if stem == "tflops":
            _mfu_axis(axes, rows)
        axes.set(xlabel="step", ylabel=ylabel, title=f"{title}: {stem.replace('_', ' ')}")
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


def summary(rows: Rows) -> list[tuple[str, str]]:
    """(what, value) lines for the terminal table."""
    train = [row for row in rows if "loss" in row]
    valid = [row for row in rows if "valid/loss" in row]
    lines = [("steps logged", f"{rows[0]['step']} … {rows[-1]['step']} ({len(train)} train, {len(valid)} validation)")]
    if train:
        best = min(train, key=lambda row: row["loss"])
        lines.append(("train loss", f"{train[0]['loss']:.4f} → {train[-1]['loss']:.4f} "
                                    f"(lowest {best['loss']:.4f} at step {best['step']})"))
    if valid:
        best = min(valid, key=lambda row: row["valid/loss"])
        lines.append(("validation loss", f"last {valid[-1]['valid/loss']:.4f} at step {valid[-1]['step']}; "
                                         f"best {best['valid/loss']:.4f} at step {best['step']}"))

    def median(name: str) -> float | None:
        values = series(rows, name)[1]
        return statistics.median(values) if values else None

    for name, label, fmt in (("tokens_per_second_per_device", "tokens/s per device (median)", "{:,.0f}"),
                             ("samples_per_second_per_device", "samples/s per device (median)", "{:,.1f}"),
                             ("tflops_per_device", "TFLOP/s per device (median)", "{:.2f}"),
                             ("mfu", "MFU (median)", "{:.1%}"),
                             ("iteration_time", "iteration time (median)", "{:.3f} s")):
        value = median(name)
        if value is not None:
            lines.append((label, fmt.format(value)))
    peaks = [max(values) for name in ("memory/max_allocated_gb", "memory/max_rss_gb") if (values := series(rows, name)[1])]
    if peaks:
        lines.append(("peak memory", f"{max(peaks):.2f} GB"))
    last = train[-1] if train else rows[-1]
    for name, label in (("consumed_tokens", "tokens consumed"), ("consumed_samples", "samples consumed"),
                        ("skipped_updates", "skipped updates")):
        if name in last:
            lines.append((label, f"{last[name]:,.0f}"))
    return lines


def report(run_dir: Path, metrics_file: Path | None = None, out_dir: Path | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    rows = read_metrics(metrics_file or run_dir / "metrics.jsonl")
    written = plot(rows, out_dir or run_dir / "report", run_dir.resolve().name)
    table = Table(title=f"run {run_dir}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    for what, value in summary(rows):
        table.add_row(what, value)
    console = Console(highlight=False)
    console.print(table)
    for path in written:
        console.print(f"wrote {path}", soft_wrap=True)
    return 0
