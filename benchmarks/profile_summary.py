"""Profiling a plain loop for the in-memory harnesses, summarised as the profiler callback (foundry.callbacks) does.

``summarize`` (foundry/callbacks/profiler.py) groups the device time of every kernel by what it does and
measures the window's compute, exposed communication and idle time. ``summarize_chrome_trace`` does the same
from a Chrome trace file (any framework's torch.profiler export), so two frameworks' steps compare alike.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from foundry.callbacks.profiler import (
    KERNEL_CATEGORIES,
    kernel_category,
    merge_intervals,
    recorded_event,
    subtract_intervals,
    summarize,
)

__all__ = [
    "KERNEL_CATEGORIES",
    "kernel_category",
    "profile_loop",
    "recorded_event",
    "summarize",
    "summarize_chrome_trace",
]
DEVICE_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def profile_loop(step: Any, num_batches: int) -> dict[str, Any]:
    """Profile ``num_batches`` calls of ``step`` (a plain loop's whole batch)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = recorded_event()
        for _ in range(num_batches):
            step()
        end = recorded_event()
        torch.cuda.synchronize()
    return summarize(prof, start.elapsed_time(end))


def summarize_chrome_trace(path: str | Path) -> dict[str, Any]:
    """``summarize``'s numbers from a Chrome trace (``.json`` or ``.json.gz``): the window is the span from the
    first device event's start to the last one's end; ``ms`` sums each kernel category's device time."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as file:
        trace = json.load(file)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    device = [event for event in events if event.get("ph") == "X" and event.get("cat") in DEVICE_EVENT_CATEGORIES]
    if not device:
        return {"error": f"no device events in {path}"}
    by_category = {label: 0.0 for label, _ in KERNEL_CATEGORIES}
    by_kernel: dict[str, float] = {}
    compute, comm = [], []
    for event in device:
        start, duration = float(event["ts"]), float(event.get("dur", 0.0))
        category = kernel_category(event["name"])
        by_category[category] += duration / 1e3
        by_kernel[event["name"]] = by_kernel.get(event["name"], 0.0) + duration / 1e3
        (comm if category == "comm" else compute).append((start, start + duration))
    first, last = min(start for start, _ in compute + comm), max(end for _, end in compute + comm)
    wall_ms = (last - first) / 1e3
    compute_merged = merge_intervals(compute)
    compute_ms = sum(end - start for start, end in compute_merged) / 1e3
    comm_only_ms = sum(end - start for start, end in subtract_intervals(merge_intervals(comm), compute_merged)) / 1e3
    top = sorted(by_kernel.items(), key=lambda item: item[1], reverse=True)[:40]
    return {
        "wall_ms": wall_ms,
        "ms": by_category,
        "share": {label: ms / wall_ms for label, ms in by_category.items()} if wall_ms else {},
        "timeline": {"compute_ms": compute_ms, "exposed_comm_ms": comm_only_ms,
                     "idle_ms": max(wall_ms - compute_ms - comm_only_ms, 0.0)},
        "top_kernels": [(name[:90], kernel_category(name), ms) for name, ms in top],
    }  # fmt: skip
