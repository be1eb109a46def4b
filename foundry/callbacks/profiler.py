"""Where a few batches' time goes: torch.profiler over a window, a summary per rank, a trace to open.

``callbacks: {profiler: {}}`` profiles batch 2 (the first pays for compilation) and writes, per rank,
``rank{r}.summary.json`` and, with ``trace``, ``rank{r}.trace.json.gz`` (open it in Perfetto or
chrome://tracing). The summary groups kernel time by what the kernel does (GEMM, attention,
elementwise and norms, optimizer, communication) and measures, on the device's timeline, how much of the
window was compute, how much communication ran with no compute beside it (``exposed_comm_ms``: what
overlap failed to hide) and how long the device sat idle (launch gaps, host syncs, a host falling
behind). Those three numbers are what a sharded run loses against an unsharded one.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from foundry import registry
from foundry.core.callback import Callback
from foundry.core.logger import Logger
from foundry.core.paths import run_subfolder
from foundry.core.state import State
from foundry.errors import ConfigError

# First match wins; names are CUDA/HIP/Triton kernel names (lower case).
KERNEL_CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("comm", re.compile(r"nccl|rccl")),
    ("data", re.compile(r"memcpy htod|memcpy dtoh")),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|cudnn_generated")),
    ("optimizer", re.compile(r"adam|multi_tensor_apply|foreach|lerp")),
    # inductor's float8 casts (a scaled, clamped copy, with what it fused into them); the amax reductions
    # before them are usually fused into a GELU or layer norm kernel and stay under elementwise+norm
    ("float8 cast", re.compile(r"^triton_.*(amax|clamp)")),
    ("gemm", re.compile(r"gemm|nvjet|sm\d+_xmma|cutlass|wgmma|splitk|matmul|mm_")),
    ("elementwise+norm", re.compile(r".")),
)


# Events where the host waits for the device: a runtime synchronize, or a scalar or tensor read to the host
# (``.item()``, ``.tolist()``, ``.cpu()``, a Python ``if`` on a device tensor), which waits for all queued work.
HOST_SYNC_EVENTS = (
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
    "aten::_local_scalar_dense", "Memcpy DtoH",
)  # fmt: skip


def host_sync_counts(prof: profile) -> dict[str, int]:
    """How many times each of ``HOST_SYNC_EVENTS`` happened in the window (a sync-free step has none but the
    window's own end)."""
    counts = dict.fromkeys(HOST_SYNC_EVENTS, 0)
    for event in prof.key_averages():
        for name in HOST_SYNC_EVENTS:
            if event.key.startswith(name):  # "Memcpy DtoH (Device -> Pinned)" and the like
                counts[name] += event.count
    return counts


def kernel_category(kernel_name: str) -> str:
    name = kernel_name.lower()
    return next(label for label, pattern in KERNEL_CATEGORIES if pattern.search(name))


def summarize(prof: profile, wall_ms: float) -> dict[str, Any]:
    """Milliseconds per kernel category in a window of ``wall_ms``, the timeline's overlap, the top kernels.

    ``ms`` sums each category's kernel time (communication kernels run beside compute, so the sum can
    exceed the window); ``timeline`` measures the window itself: ``compute_ms`` (some non-communication
    kernel running), ``exposed_comm_ms`` (only communication running) and ``idle_ms`` (nothing).
    """
    by_category: dict[str, float] = {label: 0.0 for label, _ in KERNEL_CATEGORIES}
    # Device-side events only: a CPU op's "self device time" repeats its kernels' time.
    kernels = [event for event in prof.key_averages() if is_device_work(event)]
    for event in kernels:
        by_category[kernel_category(event.key)] += event.self_device_time_total / 1e3
    top = sorted(kernels, key=lambda event: event.self_device_time_total, reverse=True)[:40]
    compute_ms, comm_only_ms = _timeline(prof)
    timeline = {
        "compute_ms": compute_ms,
        "exposed_comm_ms": comm_only_ms,
        "idle_ms": max(wall_ms - compute_ms - comm_only_ms, 0.0),
    }
    return {
        "wall_ms": wall_ms,
        "ms": by_category,
        "share": {label: ms / wall_ms for label, ms in by_category.items()} if wall_ms else {},
        "timeline": timeline,
        "host_syncs": host_sync_counts(prof),
        "top_kernels": [
            (event.key[:90], kernel_category(event.key), event.self_device_time_total / 1e3) for event in top
        ],
    }


def _timeline(prof: profile) -> tuple[float, float]:
    """(ms with some compute kernel running, ms with only communication kernels running) over the trace."""
    return device_timeline(
        (event.name, event.time_range.start, event.time_range.end)
        for event in prof.events()
        if is_device_work(event) and event.time_range.elapsed_us() > 0
    )


def is_device_work(event: Any) -> bool:
    """A kernel, copy or memset on the device; not a user annotation's range on the device's timeline
    (``record_function`` spans such as FSDP's "FSDP::all_gather (...)", "nccl:_all_gather_base" or
    "Optimizer.step#..."), which cover kernels already counted and would count them twice."""
    return event.device_type == DeviceType.CUDA and not getattr(event, "is_user_annotation", False)


def device_timeline(kernels: Iterable[tuple[str, float, float]]) -> tuple[float, float]:
    """(ms with some compute kernel running, ms with only communication running) of (name, start µs, end µs)."""
    compute, comm = [], []
    for name, start, end in kernels:
        (comm if kernel_category(name) == "comm" else compute).append((start, end))
    compute_merged = merge_intervals(compute)
    compute_us = sum(end - start for start, end in compute_merged)
    comm_only_us = sum(
        end - start for start, end in subtract_intervals(merge_intervals(comm), compute_merged)
    )  # fmt: skip
    return compute_us / 1e3, comm_only_us / 1e3


def merge_intervals(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping cover of ``spans``."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def subtract_intervals(spans: list[tuple[float, float]], holes: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of ``spans`` outside ``holes`` (both merged and sorted)."""
    left: list[tuple[float, float]] = []
    index = 0
    for start, end in spans:
        while index < len(holes) and holes[index][1] <= start:
            index += 1
        cursor, scan = start, index
        while scan < len(holes) and holes[scan][0] < end:
            if holes[scan][0] > cursor:
                left.append((cursor, holes[scan][0]))
            cursor = max(cursor, holes[scan][1])
            scan += 1
        if cursor < end:
            left.append((cursor, end))
    return left


@registry.callbacks.register("profiler")
class Profiler(Callback):
    """Profiles batches ``skip_batches + 1`` to ``skip_batches + batches``; writes a summary (and trace) per rank.

    Read throughput from a run without it: the window's batches record every launch, and the batch after
    the window pays for processing the trace. On a device without CUDA it warns once and writes nothing.

    Args:
        skip_batches: Batches before the window (the first pays for compilation and lazy init).
        batches: Batches in the window.
        trace: Also write the Chrome/Perfetto trace (tens of MB for a large batch).
        folder: Where files go; ``{run_folder}`` and ``{run_name}`` are filled in.
    """

    def __init__(
        self, skip_batches: int = 1, batches: int = 1, trace: bool = True, folder: str = "{run_folder}/profile"
    ) -> None:
        if skip_batches < 0 or batches < 1:
            raise ConfigError(
                f"callbacks.profiler: skip_batches must be >= 0 and batches >= 1 (got {skip_batches} and {batches})."
            )
        self.first_batch, self.last_batch = skip_batches + 1, skip_batches + batches
        self.trace = trace
        self.folder = folder
        self.summary: dict[str, Any] | None = None
        self.written: list[Path] = []
        self._profiler: profile | None = None
        self._start: torch.cuda.Event | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        if state.device.type != "cuda":
            self.first_batch = self.last_batch = -1
            warnings.warn(
                f"callbacks.profiler summarises GPU kernels and this run is on '{state.device}'; it writes nothing. "
                "Remove it from callbacks to silence this warning.",
                stacklevel=2,
            )

    def batch_start(self, state: State, logger: Logger) -> None:
        if state.timestamp.batch + 1 == self.first_batch:
            torch.cuda.synchronize()  # the window starts with an idle device, not the last batch's tail
            self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self._profiler.__enter__()
            self._start = recorded_event()

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._profiler is None or state.timestamp.batch != self.last_batch:
            return
        end = recorded_event()
        torch.cuda.synchronize()
        self._profiler.__exit__(None, None, None)
        self.summary = summarize(self._profiler, self._start.elapsed_time(end))
        self.summary["batches"] = [self.first_batch, self.last_batch]
        folder = run_subfolder(self.folder, state.run_folder, state.run_name)
        folder.mkdir(parents=True, exist_ok=True)
        summary_path = folder / f"rank{state.rank}.summary.json"
        summary_path.write_text(json.dumps(self.summary, indent=1))
        self.written.append(summary_path)
        if self.trace:
            trace_path = folder / f"rank{state.rank}.trace.json.gz"
            self._profiler.export_chrome_trace(str(trace_path))
            self.written.append(trace_path)
        self._profiler = None
        timeline = self.summary["timeline"]
        logger.log_text(
            f"Profile of batches {self.first_batch}-{self.last_batch} (rank {state.rank}): "
            f"{self.summary['wall_ms']:.0f} ms, compute {timeline['compute_ms']:.0f}, exposed communication "
            f"{timeline['exposed_comm_ms']:.0f}, idle {timeline['idle_ms']:.0f}; {summary_path}"
        )

    def close(self) -> None:
        if self._profiler is not None:  # the run ended inside the window
            self._profiler.__exit__(None, None, None)
            self._profiler = None


def recorded_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
