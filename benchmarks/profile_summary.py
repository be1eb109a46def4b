"""Where a training step's GPU time goes: GEMM, attention, elementwise+norm, optimizer, data, idle gaps.

``summarize(profiler, wall_ms)`` groups the self device time of every kernel in a torch.profiler
trace by its name; what the kernels do not cover of the window's GPU wall time is idle (launch
gaps, host syncs, the host falling behind).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from foundry import Callback

# First match wins; names are CUDA/Triton kernel names (lower case).
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("data", re.compile(r"memcpy htod|memcpy dtoh")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn_generated")),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|foreach|lerp")),
    # inductor's float8 casts (a scaled, clamped copy, with what it fused into them); the amax reductions
    # before them are usually fused into a GELU or layer norm kernel and stay under elementwise+norm
    ("float8 cast", re.compile(r"^triton_.*(amax|clamp)")),
    ("gemm", re.compile(r"gemm|nvjet|sm\d+_xmma|cutlass|wgmma|splitk|matmul|mm_")),
    ("elementwise+norm", re.compile(r".")),
)


def category(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next(label for label, pattern in CATEGORIES if pattern.search(name))


def summarize(prof: profile, wall_ms: float) -> dict[str, Any]:
    """Milliseconds per category (per profiled window), their shares of ``wall_ms``, and the top kernels."""
    by_category: dict[str, float] = {label: 0.0 for label, _ in CATEGORIES}
    # Device-side events only: a CPU op's "self device time" repeats its kernels' time.
    kernels = [event for event in prof.key_averages() if event.device_type == DeviceType.CUDA]
    for event in kernels:
        by_category[category(event.key)] += event.self_device_time_total / 1e3
    busy_ms = sum(by_category.values())
    by_category["idle"] = max(wall_ms - busy_ms, 0.0)
    top = sorted(kernels, key=lambda event: event.self_device_time_total, reverse=True)[:40]
    return {
        "wall_ms": wall_ms,
        "ms": by_category,
        "share": {label: ms / wall_ms for label, ms in by_category.items()},
        "top_kernels": [(event.key[:90], category(event.key), event.self_device_time_total / 1e3) for event in top],
    }


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
