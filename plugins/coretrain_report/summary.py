"""The report's tables: one run's summary, and the final values several runs are compared on.

Every evaluated metric is in them — ``valid/loss``, ``valid/accuracy``, a named set's
``valid/wiki/loss``, your model's own values, ``test/...`` — not only the loss; rates are
printed with significant digits, so a tiny model's TFLOP/s is not "0.00".
"""

from __future__ import annotations

import statistics
from typing import Any

Rows = list[dict[str, Any]]

LOWER_IS_BETTER = ("loss", "ppl", "error", "perplexity")


def series(rows: Rows, name: str, x: str = "step") -> tuple[list[float], list[float]]:
    points = [
        (row[x], row[name])
        for row in rows
        if isinstance(row.get(name), (int, float)) and isinstance(row.get(x), (int, float))
    ]
    if x != "step":  # evaluation rows carry no x of their own: take the last train row's
        last: dict[int, float] = {}
        for row in rows:
            if isinstance(row.get(x), (int, float)):
                last[row["step"]] = row[x]
        points = [(last.get(row["step"]), row[name]) for row in rows if isinstance(row.get(name), (int, float))]
        points = [(px, v) for px, v in points if px is not None]
    return [p for p, _ in points], [v for _, v in points]


def lower_is_better(name: str) -> bool:
    return name.rsplit("/", 1)[-1].endswith(LOWER_IS_BETTER)


def number_format(name: str) -> str:
    """Losses with 4 decimals (as the train loss), other values with 4 significant digits."""
    return "{:.4f}" if lower_is_better(name) else "{:.4g}"


def evaluated_names(rows: Rows) -> list[str]:
    """Every evaluated metric the rows hold: valid/... then test/..., in first-seen order."""
    names = dict.fromkeys(k for row in rows for k in row if k.startswith(("valid/", "test/")))
    return sorted(names, key=lambda name: (not name.startswith("valid/"), name != "valid/loss"))


def evaluated_line(rows: Rows, name: str) -> tuple[str, str]:
    """Its line: "last 0.91 at step 600; best 0.93 at step 400" (best: the lowest of a loss, else
    the highest)."""
    steps, values = series(rows, name)
    pick = min if lower_is_better(name) else max
    best = pick(range(len(values)), key=values.__getitem__)
    fmt = number_format(name)
    text = f"last {fmt.format(values[-1])} at step {steps[-1]:.0f}"
    if len(values) > 1:
        text += f"; best {fmt.format(values[best])} at step {steps[best]:.0f}"
    return name, text


def summary(rows: Rows) -> list[tuple[str, str]]:
    """(what, value) lines for the terminal table."""
    train = [row for row in rows if "loss" in row]
    valid = [row for row in rows if any(name.startswith("valid/") for name in row)]
    lines = [("steps logged", f"{rows[0]['step']} … {rows[-1]['step']} ({len(train)} train, {len(valid)} validation)")]
    if train:
        best = min(train, key=lambda row: row["loss"])
        lines.append(
            (
                "train loss",
                f"{train[0]['loss']:.4f} → {train[-1]['loss']:.4f} (lowest {best['loss']:.4f} at step {best['step']})",
            )
        )
    lines += [evaluated_line(rows, name) for name in evaluated_names(rows)]
    lines += [
        (name, f"last {series(rows, name)[1][-1]:.4g}")
        for name in dict.fromkeys(k for row in rows for k in row if k.startswith("train/"))
    ]

    def median(name: str) -> float | None:
        values = series(rows, name)[1]
        return statistics.median(values) if values else None

    for name, label, fmt in (
        ("tokens_per_second_per_device", "tokens/s per device (median)", "{:,.0f}"),
        ("samples_per_second_per_device", "samples/s per device (median)", "{:,.1f}"),
        ("tflops_per_device", "TFLOP/s per device (median)", "{:.3g}"),
        ("mfu", "MFU (median)", "{:.1%}"),
        ("iteration_time", "iteration time (median)", "{:.3f} s"),
    ):
        value = median(name)
        if value is not None:
            lines.append((label, fmt.format(value)))
    peaks = [
        max(values) for name in ("memory/max_allocated_gb", "memory/max_rss_gb") if (values := series(rows, name)[1])
    ]
    if peaks:
        lines.append(("peak memory", f"{max(peaks):.2f} GB"))
    last = train[-1] if train else rows[-1]
    for name, label in (
        ("consumed_tokens", "tokens consumed"),
        ("consumed_samples", "samples consumed"),
        ("skipped_updates", "skipped updates"),
    ):
        if name in last:
            lines.append((label, f"{last[name]:,.0f}"))
    return lines


FINALS: list[tuple[str, str, str]] = [
    # (what, how to get it from a run's rows, format) for the comparison table
    ("steps", "last:step", "{:,.0f}"),
    ("train loss (last)", "last:loss", "{:.4f}"),
    ("tokens/s per device (median)", "median:tokens_per_second_per_device", "{:,.0f}"),
    ("samples/s per device (median)", "median:samples_per_second_per_device", "{:,.1f}"),
    ("TFLOP/s per device (median)", "median:tflops_per_device", "{:.3g}"),
    ("iteration time (median)", "median:iteration_time", "{:.4f}"),
    ("waiting for data, s/step (median)", "median:time/data", "{:.4f}"),
    ("peak memory GB", "max:memory/max_rss_gb|memory/max_allocated_gb", "{:.2f}"),
    ("wall time s", "last:elapsed_seconds", "{:,.1f}"),
]


def final(rows: Rows, how: str) -> float | None:
    kind, names = how.split(":", 1)
    for name in names.split("|"):
        values = series(rows, name)[1]
        if values:
            return {"last": values[-1], "min": min(values), "max": max(values), "median": statistics.median(values)}[
                kind
            ]
    return None


def evaluated_finals(runs: list[Rows]) -> list[tuple[str, str, str]]:
    """Comparison rows for every evaluated metric of any run: its last value and its best."""
    names = evaluated_names([row for rows in runs for row in rows])
    return [
        row
        for name in names
        for row in (
            (f"{name} (last)", f"last:{name}", number_format(name)),
            (f"{name} (best)", f"{'min' if lower_is_better(name) else 'max'}:{name}", number_format(name)),
        )
    ]
