"""Derived metrics for ``on_log``: throughput, FLOPs, MFU, time, memory — once per log interval.

Everything here turns values the loop already has on the host into more values; nothing
touches the device except reading CUDA allocator statistics, which does not synchronize.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from coretrain.run import Run

import os
import resource
import sys

import torch

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}
"""Dense bf16 tensor-core peaks per device (vendor datasheets), matched by substring of the name."""

GB = 1024**3
CUDA_MEMORY_KEYS = {  # Megatron's report_memory set: torch.cuda.memory_stats key -> metric name
    "allocated_bytes.all.current": "memory/allocated_gb",
    "allocated_bytes.all.peak": "memory/max_allocated_gb",
    "active_bytes.all.current": "memory/active_gb",
    "active_bytes.all.peak": "memory/max_active_gb",
    "inactive_split_bytes.all.current": "memory/inactive_gb",
    "inactive_split_bytes.all.peak": "memory/max_inactive_gb",
    "reserved_bytes.all.current": "memory/reserved_gb",
    "reserved_bytes.all.peak": "memory/max_reserved_gb",
}


def peak_tflops(run: Run) -> float | None:
    """``run.peak_tflops`` if set, else the table's entry for this GPU, else unknown."""
    if run.config.run.peak_tflops:
        return run.config.run.peak_tflops
    if run.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(run.device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


def throughput(run: Run, samples_per_second: float, iteration_time: float, elapsed: float) -> dict[str, float]:
    """Tokens, FLOPs and MFU per device, consumed tokens, elapsed and estimated remaining time."""
    world = run.dist.world_size
    metrics = {
        "samples_per_second_per_device": samples_per_second / world,
        "elapsed_seconds": elapsed,
        "remaining_seconds": max(run.config.train.train_iters - run.state.step, 0) * iteration_time,
    }
    if run.flops_per_sample:
        tflops = samples_per_second * run.flops_per_sample / world / 1e12
        metrics["tflops_per_device"] = tflops
        peak = peak_tflops(run)
        if peak:
            metrics["mfu"] = tflops / peak
    seq_length = run.datasets.seq_length
    if seq_length:
        metrics["tokens_per_second_per_device"] = samples_per_second * seq_length / world
        metrics["consumed_tokens"] = float(run.state.consumed_samples * seq_length)
    return metrics


def memory(device: torch.device) -> dict[str, float]:
    """CUDA allocator statistics in GB (and alloc retries); on CPU the process RSS and its peak."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        values = {name: stats.get(key, 0) / GB for key, name in CUDA_MEMORY_KEYS.items()}
        values["memory/alloc_retries"] = float(stats.get("num_alloc_retries", 0))
        return values
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    peak = peak_kb if sys.platform == "darwin" else peak_kb * 1024
    try:
        with open("/proc/self/statm") as statm:
            rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        rss = peak
    return {"memory/rss_gb": rss / GB, "memory/max_rss_gb": max(peak, rss) / GB}  # rss read a moment later
