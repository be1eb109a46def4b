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

from foundry.callbacks.profiler import KERNEL_CATEGORIES, device_timeline, kernel_category, recorded_event, summarize

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
    spans = [(event["name"], float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))) for event in device]
    by_category = {label: 0.0 for label, _ in KERNEL_CATEGORIES}
    by_kernel: dict[str, float] = {}
    for name, start, end in spans:
        by_category[kernel_category(name)] += (end - start) / 1e3
        by_kernel[name] = by_kernel.get(name, 0.0) + (end - start) / 1e3
    wall_ms = (max(end for _, _, end in spans) - min(start for _, start, _ in spans)) / 1e3
    compute_ms, comm_only_ms = device_timeline(spans)
    top = sorted(by_kernel.items(), key=lambda item: item[1], reverse=True)[:40]
    return {
        "wall_ms": wall_ms,
        "ms": by_category,
        "share": {label: ms / wall_ms for label, ms in by_category.items()} if wall_ms else {},
        "timeline": {"compute_ms": compute_ms, "exposed_comm_ms": comm_only_ms,
                     "idle_ms": max(wall_ms - compute_ms - comm_only_ms, 0.0)},
        "top_kernels": [(name[:90], kernel_category(name), ms) for name, ms in top],
    }  # fmt: skip
