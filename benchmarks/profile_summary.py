"""Profiling for the in-memory harnesses: a Trainer window or a plain loop, summarised as the profiler callback does.

``summarize`` (foundry/callbacks/profiler.py) groups the device time of every kernel by what it does and
measures the window's compute, exposed communication and idle time.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from foundry import Callback
from foundry.callbacks.profiler import KERNEL_CATEGORIES, kernel_category, summarize

__all__ = ["KERNEL_CATEGORIES", "ProfileWindow", "kernel_category", "profile_loop", "recorded_event", "summarize"]


class ProfileWindow(Callback):
    """Profile batches ``first_batch + 1 .. first_batch + num_batches`` of a Trainer run."""

    def __init__(self, first_batch: int, num_batches: int) -> None:
        self.first_batch, self.num_batches = first_batch, num_batches
        self.profiler: profile | None = None
        self.marks: list[torch.cuda.Event] = []
        self.summary: dict[str, Any] | None = None

    def batch_end(self, state, logger) -> None:
        batch = state.timestamp.batch
        if batch == self.first_batch:
            self.profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.profiler.__enter__()
            self.marks.append(recorded_event())
        elif batch == self.first_batch + self.num_batches and self.profiler is not None:
            self.marks.append(recorded_event())
            torch.cuda.synchronize()
            self.profiler.__exit__(None, None, None)
            self.summary = summarize(self.profiler, self.marks[0].elapsed_time(self.marks[1]))


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


def recorded_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
