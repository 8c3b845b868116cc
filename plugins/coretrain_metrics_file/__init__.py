"""``metrics-file``: every logged and evaluated step as one JSON object per line in metrics.jsonl.

Floats are written with ``repr`` precision (json's default), so reading the file back gives
exactly the values the run computed. On resume, lines after the resumed step (from the
interrupted timeline) are dropped, so each step appears once. A
:class:`~coretrain.backend.LoggingBackend`, so it records what every other plugin added.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO, Any

from attrs import define, field

from coretrain.backend import LoggingBackend


@define(kw_only=True)
class MetricsFile(LoggingBackend):
    """Writes metrics.jsonl in the run's output dir (rank 0)."""

    filename: str = "metrics.jsonl"
    """File name inside run.output_dir."""
    _file: IO[str] | None = field(default=None, init=False, repr=False)

    def open(self, run: Any) -> None:
        path = Path(run.output_dir) / self.filename
        if path.exists():
            kept = [line for line in path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= run.state.step]
            path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        self._file = open(path, "a", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self, outcome: str) -> None:
        self._file.close()
