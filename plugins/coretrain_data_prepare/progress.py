"""Progress of ``data prepare``: a rich bar over the input bytes on a terminal, a plain line
every ``log_interval`` documents otherwise (Megatron's preprocess_data.py prints the same)."""

from __future__ import annotations

import sys
import time

from rich.progress import BarColumn, DownloadColumn, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.progress import Progress as Bar


class Progress:
    """Documents and input bytes done so far, shown as they advance."""

    def __init__(self, total_bytes: int, log_interval: int) -> None:
        self.documents, self.bytes, self.log_interval = 0, 0, log_interval
        self.started = time.perf_counter()
        self.bar: Bar | None = None
        if sys.stderr.isatty():
            self.bar = Bar(
                TextColumn("tokenizing"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TextColumn("{task.fields[documents]:,} documents"),
                TimeRemainingColumn(),
                transient=True,
            )
            self.task = self.bar.add_task("tokenizing", total=total_bytes, documents=0)
            self.bar.start()

    def advance(self, documents: int, size: int) -> None:
        before = self.documents
        self.documents, self.bytes = self.documents + documents, self.bytes + size
        if self.bar is not None:
            self.bar.update(self.task, completed=self.bytes, documents=self.documents)
        elif self.documents // self.log_interval > before // self.log_interval:
            elapsed = max(time.perf_counter() - self.started, 1e-9)
            print(
                f"processed {self.documents:,} documents ({self.documents / elapsed:,.0f} docs/s, "
                f"{self.bytes / elapsed / 1e6:.2f} MB/s)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
