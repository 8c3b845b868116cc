"""Memory metrics for each log: CUDA allocator statistics (Megatron's report_memory set) in GB,
or on CPU the process RSS and its peak; or the statistics a config picks and names
(``memory_keys``). Reading allocator statistics does not synchronize."""

from __future__ import annotations

import os
import resource
import sys

import torch

from coretrain import UserError

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


def _statistics(device: torch.device) -> dict[str, float]:
    """What ``memory_keys`` may pick from: torch.cuda.memory_stats, or on CPU the RSS's two."""
    if device.type == "cuda":
        return {key: float(value) for key, value in torch.cuda.memory_stats(device).items()}
    cpu = memory(device)
    return {"rss_bytes.current": cpu["memory/rss_gb"] * GB, "rss_bytes.peak": cpu["memory/max_rss_gb"] * GB}


def selected_memory(device: torch.device, keys: dict[str, str]) -> dict[str, float]:
    """``memory_keys``: each statistic under its configured name, bytes in GB (counts as counted)."""
    stats = _statistics(device)
    if missing := sorted(set(keys) - set(stats)):
        known = ", ".join(sorted(stats)[:12])
        raise UserError(
            f"plugins.timers.memory_keys: {missing} are not memory statistics on {device.type}; some are: {known}"
        )
    return {name: stats[key] / GB if "bytes" in key else stats[key] for key, name in keys.items()}
