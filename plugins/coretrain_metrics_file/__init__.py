"""``metrics-file``: every logged and evaluated step as one JSON object per line in metrics.jsonl.

Floats are written with ``repr`` precision (json's default), so reading the file back gives
exactly the values the run computed. On resume, lines after the resumed step (from the
interrupted timeline) are dropped, so each step appears once, and a line a crash or a full
disk left half-written is dropped too (with a warning), so it never blocks a restart. A
:class:`~coretrain_backends.LoggingBackend`, so it records what every other plugin added.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO

from attrs import define, field
from coretrain_backends import LoggingBackend

from coretrain import Outcome, Run

log = logging.getLogger("coretrain")


def rows_up_to(path: Path, step: int) -> tuple[list[str], int]:
    """The file's complete JSON lines with ``step`` <= step, and how many torn lines were dropped."""
    kept, torn = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line)
    return kept, torn


def rewrite(path: Path, lines: list[str]) -> None:
    """Replace ``path`` atomically: a crash while trimming must not lose the rows kept."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@define(kw_only=True)
class MetricsFile(LoggingBackend):
    """Writes metrics.jsonl in the run's output dir (rank 0)."""

    filename: str = "metrics.jsonl"
    """File name inside run.output_dir."""
    _file: IO[str] | None = field(default=None, init=False, repr=False)

    def open(self, run: Run) -> None:
        path = Path(run.output_dir) / self.filename
        if path.exists():
            kept, torn = rows_up_to(path, run.state.step)
            if torn:
                log.warning("metrics-file: dropped %d unreadable line(s) of %s (a write cut short)", torn, path)
            rewrite(path, kept)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        assert self._file is not None, "open() comes first"
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self, outcome: Outcome) -> None:
        if self._file is not None:
            self._file.close()
