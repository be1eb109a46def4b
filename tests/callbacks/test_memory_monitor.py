"""MemoryMonitor: GiB from the allocator's counters on CUDA; the process's host memory on CPU, without a warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from foundry.callbacks import MemoryMonitor
from foundry.errors import ConfigError

_STATS = {
    "allocated_bytes.all.current": 2 * 2**30,
    "allocated_bytes.all.peak": 3 * 2**30,
    "reserved_bytes.all.current": 4 * 2**30,
    "reserved_bytes.all.peak": 5 * 2**30,
    "inactive_split_bytes.all.current": 2**29,
    "num_alloc_retries": 7,
}


@pytest.fixture
def fake_cuda(state, monkeypatch):
    """Pretend the run is on a GPU whose allocator reports ``_STATS``."""
    state.device = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(_STATS))


def test_cpu_logs_the_processs_host_memory_without_a_warning(recorder, train_batch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_batch(MemoryMonitor())
    (metrics,) = [call[0] for call in recorder.calls]
    assert set(metrics) == {"memory/host_rss_mem", "memory/host_peak_rss_mem"}
    assert all(0 < gib < 1024 for gib in metrics.values())


@pytest.mark.usefixtures("fake_cuda")
def test_cuda_logs_bytes_in_gib_and_counts_as_is(recorder, train_batch):
    train_batch(MemoryMonitor())
    assert recorder.calls[-1][0] == {
        "memory/allocated_mem": 2.0,
        "memory/peak_allocated_mem": 3.0,
        "memory/reserved_mem": 4.0,
        "memory/peak_reserved_mem": 5.0,
        "memory/inactive_mem": 0.5,
        "memory/alloc_retries": 7.0,
    }


@pytest.mark.usefixtures("fake_cuda")
def test_memory_keys_choose_stats_and_names(recorder, train_batch):
    train_batch(MemoryMonitor(memory_keys={"reserved_bytes.all.peak": "max_reserved"}))
    assert recorder.calls[-1][0] == {"memory/max_reserved": 5.0}


@pytest.mark.usefixtures("fake_cuda")
def test_unknown_memory_key_names_the_key(train_batch):
    with pytest.raises(ConfigError, match="reserved_bytes.all.peek"):
        train_batch(MemoryMonitor(memory_keys={"reserved_bytes.all.peek": "max_reserved"}))
