"""MemorySnapshot: records the right batches and writes pickle + HTML on CUDA; warns and writes nothing on CPU."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from foundry.callbacks import MemorySnapshot
from foundry.core import Event
from foundry.errors import ConfigError


@pytest.fixture
def fake_cuda(state, monkeypatch, tmp_path) -> list:
    """Pretend the run is on a GPU; returns the calls made to torch's memory-history API."""
    calls: list = []
    state.device = torch.device("cuda", 0)
    state.run_folder = str(tmp_path)
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda enabled="all", **kw: calls.append((enabled, kw))
    )
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [], "device_traces": [["event"]]})
    monkeypatch.setattr(torch.cuda._memory_viz, "trace_plot", lambda snapshot: "<html></html>")
    return calls


def _train(snapshot: MemorySnapshot, state, fire, num_batches: int) -> None:
    fire(snapshot, Event.FIT_START)
    for _ in range(num_batches):
        fire(snapshot, Event.BATCH_START)
        state.timestamp = state.timestamp.after_batch(1, 1, 0.0)
        fire(snapshot, Event.BATCH_END)


def test_records_interval_batches_after_skip_and_writes_both_files(state, fire, fake_cuda, tmp_path):
    snapshot = MemorySnapshot(skip_batches=1, interval="3ba", max_entries=50)
    _train(snapshot, state, fire, num_batches=6)
    assert fake_cuda == [("all", {"max_entries": 50}), (None, {})]  # one recording: started, then stopped
    folder = tmp_path / "memory_snapshots"
    assert sorted(path.name for path in folder.iterdir()) == ["rank0.batch2-4.html", "rank0.batch2-4.pickle"]
    assert pickle.loads((folder / "rank0.batch2-4.pickle").read_bytes())["device_traces"] == [["event"]]


def test_a_batch_list_starts_one_recording_per_listed_batch(state, fire, fake_cuda, tmp_path):
    snapshot = MemorySnapshot(interval="1ba", batches=[1, 3], folder=str(tmp_path / "snaps"))
    _train(snapshot, state, fire, num_batches=4)
    assert sorted(path.name for path in snapshot.written) == [
        "rank0.batch1-1.html",
        "rank0.batch1-1.pickle",
        "rank0.batch3-3.html",
        "rank0.batch3-3.pickle",
    ]


def test_cpu_run_warns_once_and_writes_nothing(state, fire, tmp_path):
    state.run_folder = str(tmp_path)
    snapshot = MemorySnapshot(skip_batches=0, interval="1ba")
    with pytest.warns(UserWarning, match="records CUDA allocations"):
        fire(snapshot, Event.FIT_START)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train(snapshot, state, fire, num_batches=2)
    assert list(tmp_path.iterdir()) == []


def test_interval_must_be_in_batches():
    with pytest.raises(ConfigError, match="interval"):
        MemorySnapshot(interval="1ep")
