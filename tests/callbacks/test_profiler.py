"""Profiler: the timeline arithmetic, its config checks, and a real profiled window on a GPU (skipped on CPU)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from foundry.callbacks import Profiler
from foundry.callbacks.profiler import host_sync_counts, kernel_category, merge_intervals, subtract_intervals
from foundry.core import Event
from foundry.errors import ConfigError


def test_merge_intervals_joins_overlapping_and_touching_spans():
    assert merge_intervals([(5, 7), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 7)]


def test_subtract_intervals_keeps_what_no_hole_covers():
    spans = [(0, 10), (20, 30)]
    holes = [(2, 4), (8, 22), (25, 26)]
    assert subtract_intervals(spans, holes) == [(0, 2), (4, 8), (22, 25), (26, 30)]
    assert subtract_intervals(spans, []) == spans
    assert subtract_intervals(spans, [(-5, 40)]) == []


def test_kernel_categories_tell_communication_from_compute():
    assert kernel_category("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "comm"
    assert kernel_category("nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN") == "gemm"
    assert kernel_category("triton_red_fused_native_layer_norm_0") == "elementwise+norm"


class _Profile:
    """A finished profile's two views, as ``summarize`` reads them: per-name totals and timed events."""

    def __init__(self, events):
        self._events = events

    def key_averages(self):
        return self._events

    def events(self):
        return self._events


def _device_event(name, start_us, end_us, annotation=False):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    span = SimpleNamespace(start=start_us, end=end_us, elapsed_us=lambda: end_us - start_us)
    return SimpleNamespace(key=name, name=name, count=1, device_type=DeviceType.CUDA, is_user_annotation=annotation,
                           self_device_time_total=end_us - start_us, time_range=span)  # fmt: skip


def test_summary_counts_kernels_not_the_annotation_ranges_around_them():
    """FSDP's and NCCL's record_function ranges sit on the device's timeline around kernels already counted;
    counted too, they doubled communication and put FSDP's ranges under elementwise work."""
    from foundry.callbacks.profiler import summarize

    events = [
        _device_event("ncclDevKernel_AllGather_RING_LL", 0, 4_000),
        _device_event("nccl:_all_gather_base", 0, 4_000, annotation=True),
        _device_event("FSDP::all_gather (transformer.blocks.0)", 0, 4_000, annotation=True),
        _device_event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", 2_000, 10_000),
    ]
    summary = summarize(_Profile(events), wall_ms=12.0)
    assert summary["ms"]["comm"] == 4.0 and summary["ms"]["gemm"] == 8.0
    assert summary["ms"]["elementwise+norm"] == 0.0
    assert summary["timeline"] == {"compute_ms": 8.0, "exposed_comm_ms": 2.0, "idle_ms": 2.0}
    assert [name for name, _, _ in summary["top_kernels"]] == [events[3].key, events[0].key]


def test_host_sync_counts_count_scalar_reads():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(3).sum().item()
        torch.ones(3).sum().item()
        torch.ones(3).cumsum(0)
    counts = host_sync_counts(prof)
    assert counts["aten::_local_scalar_dense"] == 2
    assert counts["cudaStreamSynchronize"] == 0


def test_bad_window_is_refused():
    with pytest.raises(ConfigError, match="callbacks.profiler"):
        Profiler(batches=0)


def test_cpu_run_warns_and_writes_nothing(state, fire, tmp_path):
    state.run_folder = str(tmp_path)
    profiler = Profiler(skip_batches=0)
    with pytest.warns(UserWarning, match="writes nothing"):
        fire(profiler, Event.FIT_START)
    fire(profiler, Event.BATCH_START)
    state.timestamp = state.timestamp.after_batch(1, 1, 0.0)
    fire(profiler, Event.BATCH_END)
    assert profiler.written == [] and not list(tmp_path.iterdir())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="profiles CUDA kernels")
def test_gpu_window_summarises_the_profiled_batch(state, fire, tmp_path):
    state.device, state.run_folder = torch.device("cuda"), str(tmp_path)
    profiler = Profiler(skip_batches=1, trace=False)
    a = torch.randn(1024, 1024, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fire(profiler, Event.FIT_START)
    for _ in range(2):
        fire(profiler, Event.BATCH_START)
        for _ in range(20):
            a = (a @ a).tanh()
        state.timestamp = state.timestamp.after_batch(1, 1, 0.0)
        fire(profiler, Event.BATCH_END)
    summary = json.loads((tmp_path / "profile" / "rank0.summary.json").read_text())
    assert summary["batches"] == [2, 2]
    assert summary["ms"]["gemm"] > 0
    timeline = summary["timeline"]
    assert 0 < timeline["compute_ms"] <= summary["wall_ms"] * 1.01
    assert timeline["exposed_comm_ms"] == 0
