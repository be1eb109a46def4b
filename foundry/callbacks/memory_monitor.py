"""Accelerator memory after each batch, from the CUDA caching allocator's counters (no host sync); on a CPU, the
process's host memory."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import torch

from foundry import registry
from foundry.core.callback import Callback
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.errors import ConfigError, did_you_mean

BYTES_PER_GIB = 2**30

# torch.cuda.memory_stats() key -> name logged under 'memory/'. Peaks are since the process started.
DEFAULT_MEMORY_KEYS = {
    "allocated_bytes.all.current": "allocated_mem",
    "allocated_bytes.all.peak": "peak_allocated_mem",
    "reserved_bytes.all.current": "reserved_mem",
    "reserved_bytes.all.peak": "peak_reserved_mem",
    # Cached but unusable slivers of split blocks: reserved minus allocated that fragmentation wastes.
    "inactive_split_bytes.all.current": "inactive_mem",
    # Times the allocator freed its whole cache and retried (cudaFree syncs the device): near-OOM and slow.
    "num_alloc_retries": "alloc_retries",
}


@registry.callbacks.register("memory_monitor")
class MemoryMonitor(Callback):
    """Logs ``memory/<name>`` at every BATCH_END: byte counters in GiB, other counters as they are.

    ``alloc_retries`` growing means the allocator had to free its cache to satisfy a request:
    the run is close to out of memory and slowed by it; a large ``inactive_mem`` means fragmentation
    (try ``expandable_segments: true``). On a CPU, where the model lives in host memory, it logs this
    process's resident memory instead (``memory/host_rss_mem`` and ``memory/host_peak_rss_mem``, GiB).
    For where the memory goes allocation by allocation, use ``memory_snapshot``.

    Args:
        memory_keys: Map from a ``torch.cuda.memory_stats()`` key to the name it is logged under;
            defaults to allocated, reserved, their peaks, inactive split memory, and allocation retries.
    """

    def __init__(self, memory_keys: dict[str, str] | None = None) -> None:
        self.memory_keys = dict(DEFAULT_MEMORY_KEYS if memory_keys is None else memory_keys)
        self._keys_checked = False

    def batch_end(self, state: State, logger: Logger) -> None:
        if state.device.type != "cuda":
            logger.log_metrics(host_memory_gib())
            return
        stats = torch.cuda.memory_stats(state.device)
        if stats and not self._keys_checked:
            self._check_keys(stats)
        metrics = {}
        for stat_key, name in self.memory_keys.items():
            value = stats.get(stat_key, 0)
            metrics[f"memory/{name}"] = value / BYTES_PER_GIB if "bytes" in stat_key else value
        logger.log_metrics(metrics)

    def _check_keys(self, stats: dict[str, int]) -> None:
        self._keys_checked = True
        for stat_key in self.memory_keys:
            if stat_key not in stats:
                raise ConfigError(
                    f"callbacks.memory_monitor.memory_keys has '{stat_key}', which torch.cuda.memory_stats() "
                    f"does not report.{did_you_mean(stat_key, stats)} "
                    "See torch.cuda.memory_stats for the valid keys."
                )


def host_memory_gib() -> dict[str, float]:
    """This process's resident memory in GiB: now (Linux's /proc/self/statm) and its peak (getrusage)."""
    metrics = {}
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
        metrics["memory/host_rss_mem"] = resident_pages * os.sysconf("SC_PAGE_SIZE") / BYTES_PER_GIB
    except (OSError, ValueError, IndexError):  # no /proc (macOS): the peak alone
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    metrics["memory/host_peak_rss_mem"] = peak * (1 if sys.platform == "darwin" else 1024) / BYTES_PER_GIB
    return metrics
