"""Memory metrics for each log: CUDA allocator statistics (Megatron's report_memory set) in GB,
or on CPU the process RSS and its peak. Reading allocator statistics does not synchronize."""

from __future__ import annotations

import os
import resource
import sys

import torch

GB = 1024**3
CUDA_MEMORY_KEYS = {  # torch.cuda.memory_stats key -> metric name
    "allocated_bytes.all.current": "memory/allocated_gb",
    "allocated_bytes.all.peak": "memory/max_allocated_gb",
    "active_bytes.all.current": "memory/active_gb",
    "active_bytes.all.peak": "memory/max_active_gb",
    "inactive_split_bytes.all.current": "memory/inactive_gb",
    "inactive_split_bytes.all.peak": "memory/max_inactive_gb",
    "reserved_bytes.all.current": "memory/reserved_gb",
    "reserved_bytes.all.peak": "memory/max_reserved_gb",
}


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
