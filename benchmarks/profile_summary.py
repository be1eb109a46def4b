"""Profiling a plain loop for the in-memory harnesses, summarised as the profiler callback (foundry.callbacks) does.

``summarize`` (foundry/callbacks/profiler.py) groups the device time of every kernel by what it does and
measures the window's compute, exposed communication and idle time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from foundry.callbacks.profiler import KERNEL_CATEGORIES, kernel_category, recorded_event, summarize

__all__ = ["KERNEL_CATEGORIES", "kernel_category", "profile_loop", "recorded_event", "summarize"]


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
