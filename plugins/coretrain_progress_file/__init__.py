"""``progress-file``: progress.txt, one line per job start and per checkpoint (rank 0).

Each line: timestamp, job id (SLURM_JOB_ID, else the process id), world size, step, and at
checkpoints the job throughput (FLOPs of this job / this job's training time / devices), the
cumulative throughput over every job of the run, and FLOPs and tokens so far. Megatron
Bridge's "Job throughput" is always 0 because it subtracts the FLOP count it has just
updated; here the job's starting point is taken once, at job start, and the cumulative
training time travels in the checkpoint. On resume, lines after the resumed step and a line
cut short by a crash are dropped, as metrics.jsonl does.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Any

from attrs import define, field

from coretrain import Run, hookimpl, non_negative

_STEP = re.compile(r"\tstep (\d+)\t")


@define(kw_only=True)
class SavedState:
    """What progress-file keeps in a checkpoint; a resume checks a saved state against it."""

    train_seconds: float = field(validator=non_negative)


@define(kw_only=True)
class ProgressFile:
    """Writes progress.txt: job starts and checkpoints with job and cumulative throughput."""

    coretrain_state = SavedState  # what on_checkpoint returns: checked before on_resume gets it

    filename: str = "progress.txt"
    """File name inside run.output_dir."""
    _job_started: float = field(default=0.0, init=False, repr=False)
    _job_start_samples: int = field(default=0, init=False, repr=False)
    _seconds_before: float = field(default=0.0, init=False, repr=False)

    def _line(self, run: Run, text: str) -> None:
        if not run.dist.is_main:
            return
        job = os.environ.get("SLURM_JOB_ID") or f"pid-{os.getpid()}"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with open(Path(run.output_dir) / self.filename, "a", encoding="utf-8") as f:
            f.write(f"{stamp}\tjob {job}\tworld {run.dist.world_size}\tstep {run.state.step}\t{text}\n")

    @hookimpl
    def on_resume(self, state: dict[str, Any]) -> None:
        self._seconds_before = float(state.get("train_seconds", 0.0))

    def _trim(self, run: Run) -> None:
        """Keep whole lines up to the resumed step (the rest belongs to a timeline that was lost)."""
        path = Path(run.output_dir) / self.filename
        if not run.dist.is_main or not path.exists():
            return
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.split("\n")
        lines = lines[:-1]  # the last piece is "" after a complete file, or a torn line
        kept = [line for line in lines if (m := _STEP.search(line)) and int(m.group(1)) <= run.state.step]
        if len(kept) != len(lines) or not text.endswith("\n") and text:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
            os.replace(tmp, path)

    @hookimpl
    def on_train_start(self, run: Run) -> None:
        self._trim(run)
        self._job_started = time.monotonic()
        self._job_start_samples = run.state.consumed_samples
        self._line(run, "job start")

    def figures(self, run: Run) -> dict[str, float]:
        """Job and cumulative throughput (TFLOP/s per device), FLOPs and tokens so far."""
        seq = run.datasets.seq_length or 0
        flops_per_sample = run.flops_per_sample or 0.0
        job_seconds = time.monotonic() - self._job_started
        job_flops = (run.state.consumed_samples - self._job_start_samples) * flops_per_sample
        total_tokens = run.state.consumed_samples * seq
        total_flops = run.state.consumed_samples * flops_per_sample
        total_seconds = self._seconds_before + job_seconds
        world = run.dist.world_size
        return {
            "job_tflops_per_device": job_flops / job_seconds / world / 1e12 if job_seconds > 0 else 0.0,
            "cumulative_tflops_per_device": total_flops / total_seconds / world / 1e12 if total_seconds > 0 else 0.0,
            "flops": total_flops,
            "tokens": float(total_tokens),
            "train_seconds": total_seconds,
        }

    @hookimpl
    def on_checkpoint(self, run: Run) -> dict[str, Any]:
        figures = self.figures(run)
        self._line(
            run,
            f"checkpoint\tjob throughput {figures['job_tflops_per_device']:.6g} TFLOP/s/device\t"
            f"cumulative throughput {figures['cumulative_tflops_per_device']:.6g} TFLOP/s/device\t"
            f"FLOPs {figures['flops']:.0f}\ttokens {figures['tokens']:.0f}",
        )
        return {"train_seconds": figures["train_seconds"]}
