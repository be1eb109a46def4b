"""SpeedMonitor: exact throughput and MFU on a fake clock, window semantics, eval and checkpoints left out."""

from __future__ import annotations

import pytest

from foundry import registry
from foundry.callbacks import SpeedMonitor, TrainClock
from foundry.core import Event
from foundry.errors import ConfigError
from foundry.schema import check_call_kwargs


def _monitor(clock, window_size=2, gpu_flops_available=None):
    return SpeedMonitor(window_size=window_size, gpu_flops_available=gpu_flops_available, clock=clock)


def test_throughput_and_mfu_are_exact_for_known_flops(state, recorder, clock, fire, train_batch, flops_model):
    state.model = flops_model(flops_per_batch=100)
    state.extra_flops_per_batch = 50
    state.world_size = 2
    monitor = _monitor(clock, window_size=2, gpu_flops_available=1000.0)
    fire(monitor, Event.FIT_START)
    clock.now = 1.0
    train_batch(monitor, samples=8, tokens=64)  # the whole batch: 4 samples of 8 tokens per rank
    clock.now = 4.0
    train_batch(monitor, samples=8, tokens=64)

    metrics, step = recorder.calls[-1]
    assert step == 2
    # 2 batches in 4 s: 8 samples, 64 tokens and 200 model FLOPs per device.
    assert metrics["throughput/batches_per_sec"] == 0.5
    assert metrics["throughput/device/samples_per_sec"] == 2.0
    assert metrics["throughput/samples_per_sec"] == 4.0
    assert metrics["throughput/device/tokens_per_sec"] == 16.0
    assert metrics["throughput/tokens_per_sec"] == 32.0
    assert metrics["throughput/device/flops_per_sec"] == 50.0
    assert metrics["throughput/flops_per_sec"] == 100.0
    assert metrics["throughput/device/mfu"] == 0.05
    assert metrics["throughput/device/hfu"] == 0.075  # (200 + 2 * 50) FLOPs / 4 s / 1000


def test_no_throughput_until_window_is_full(recorder, clock, fire, train_batch):
    monitor = _monitor(clock, window_size=3)
    fire(monitor, Event.FIT_START)
    for second in (1.0, 2.0):
        clock.now = second
        train_batch(monitor)
    assert recorder.last("throughput/batches_per_sec") is None
    clock.now = 3.0
    train_batch(monitor)
    assert recorder.last("throughput/batches_per_sec") == 1.0


def test_window_slides_over_the_last_batches_only(recorder, clock, fire, train_batch):
    monitor = _monitor(clock, window_size=2)
    fire(monitor, Event.FIT_START)
    for second in (10.0, 11.0, 14.0):  # the slow first batch leaves the window at batch 3
        clock.now = second
        train_batch(monitor)
    assert recorder.last("throughput/batches_per_sec") == 0.5  # 2 batches in 1 s + 3 s


def test_mfu_is_not_logged_on_cpu_without_override(state, recorder, clock, fire, train_batch, flops_model):
    state.model = flops_model(flops_per_batch=100)
    monitor = _monitor(clock, window_size=1)
    fire(monitor, Event.FIT_START)
    clock.now = 1.0
    train_batch(monitor)
    metrics, _ = recorder.calls[-1]
    assert metrics["throughput/device/flops_per_sec"] == 100.0
    assert "throughput/device/mfu" not in metrics
    assert "throughput/device/hfu" not in metrics


def test_no_flops_metrics_when_model_does_not_report_flops(recorder, clock, fire, train_batch):
    monitor = _monitor(clock, window_size=1, gpu_flops_available=1000.0)
    fire(monitor, Event.FIT_START)
    clock.now = 1.0
    train_batch(monitor)
    assert not any("flops" in key or "mfu" in key for key in recorder.calls[-1][0])


def test_eval_time_is_not_train_time(recorder, clock, fire, train_batch):
    monitor = _monitor(clock, window_size=2)
    fire(monitor, Event.FIT_START)
    clock.now = 1.0
    train_batch(monitor)
    fire(monitor, Event.EVAL_START)
    clock.now = 11.0
    fire(monitor, Event.EVAL_END)
    clock.now = 12.0
    train_batch(monitor)
    assert recorder.last("throughput/batches_per_sec") == 1.0
    assert recorder.last("time/eval") == 10.0 / 3600


def test_checkpoint_save_is_not_train_time(recorder, clock, fire, train_batch):
    monitor = _monitor(clock, window_size=2)
    fire(monitor, Event.FIT_START)
    clock.now = 1.0
    train_batch(monitor)
    clock.now = 6.0  # the save took 5 s; BATCH_CHECKPOINT fires once it is on disk
    fire(monitor, Event.BATCH_CHECKPOINT)
    clock.now = 7.0
    train_batch(monitor)
    assert recorder.last("throughput/batches_per_sec") == 1.0


def test_time_train_is_logged_in_hours_every_batch(recorder, clock, fire, train_batch):
    monitor = _monitor(clock, window_size=5)
    fire(monitor, Event.FIT_START)
    clock.now = 1800.0
    train_batch(monitor)
    assert recorder.last("time/train") == 0.5


def test_train_time_survives_a_checkpoint_round_trip(clock, fire):
    monitor = _monitor(clock)
    fire(monitor, Event.FIT_START)
    clock.now = 30.0
    fire(monitor, Event.FIT_END)
    resumed = _monitor(clock)
    resumed.load_state_dict(monitor.state_dict())
    assert resumed.train_clock.train_s == 30.0


def test_eval_outside_fit_does_not_start_the_train_clock():
    clock_s = iter([0.0, 5.0, 9.0])
    train_clock = TrainClock(clock=lambda: next(clock_s))
    train_clock.observe(Event.EVAL_START)
    train_clock.observe(Event.EVAL_END)
    train_clock.observe(Event.BATCH_END)
    assert (train_clock.train_s, train_clock.eval_s) == (0.0, 5.0)


def test_window_size_below_one_is_a_config_error():
    with pytest.raises(ConfigError, match="window_size"):
        SpeedMonitor(window_size=0)


def test_yaml_kwargs_are_checked_against_the_signature():
    cls = registry.callbacks.get("speed_monitor")
    assert check_call_kwargs(cls, {"window_size": 10}, "callbacks.speed_monitor") == {"window_size": 10}
    with pytest.raises(ConfigError, match="window_size"):
        check_call_kwargs(cls, {"window_sise": 10}, "callbacks.speed_monitor")
