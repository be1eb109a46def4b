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


def _timed_batch(monitor, state, fire, clock, data_s, forward_backward_s, optimizer_s, other_s) -> None:
    """Fire one batch's events, moving the clock by each phase's seconds."""
    for event, seconds in [
        (Event.BEFORE_DATALOADER, data_s),
        (Event.AFTER_DATALOADER, 0.0),
        (Event.BATCH_START, forward_backward_s),
        (Event.BEFORE_OPTIMIZER_STEP, optimizer_s),
        (Event.AFTER_OPTIMIZER_STEP, other_s),
    ]:
        fire(monitor, event)
        clock.now += seconds
    state.timestamp = state.timestamp.after_batch(4, 32, 0.0)
    fire(monitor, Event.BATCH_END)


def _timed(monitor, fire, clock, start, end, seconds) -> None:
    fire(monitor, start)
    clock.now += seconds
    fire(monitor, end)


def test_phase_seconds_are_per_batch_means_over_the_window(state, recorder, clock, fire):
    monitor = _monitor(clock, window_size=2)
    fire(monitor, Event.FIT_START)
    _timed_batch(monitor, state, fire, clock, data_s=1.0, forward_backward_s=3.0, optimizer_s=2.0, other_s=1.0)
    _timed(monitor, fire, clock, Event.EVAL_START, Event.EVAL_END, 10.0)
    _timed(monitor, fire, clock, Event.BEFORE_CHECKPOINT, Event.BATCH_CHECKPOINT, 5.0)
    _timed_batch(monitor, state, fire, clock, data_s=3.0, forward_backward_s=5.0, optimizer_s=0.0, other_s=0.0)
    metrics, _ = recorder.calls[-1]
    assert {key: value for key, value in metrics.items() if key.startswith("time/phase/")} == {
        "time/phase/data_s": 2.0,
        "time/phase/forward_backward_s": 4.0,
        "time/phase/optimizer_s": 1.0,
        "time/phase/other_s": 0.5,
        "time/phase/eval_s": 5.0,  # one 10 s eval amortised over the window's 2 batches
        "time/phase/checkpoint_s": 2.5,
    }
    assert metrics["throughput/batches_per_sec"] == 2 / 15.0  # the train phases and other add up to it


def test_epoch_end_fetch_without_a_batch_is_not_data_time(state, recorder, clock, fire):
    monitor = _monitor(clock, window_size=1)
    fire(monitor, Event.FIT_START)
    fire(monitor, Event.BEFORE_DATALOADER)  # the loader is exhausted: no AFTER_DATALOADER
    clock.now += 4.0
    fire(monitor, Event.EPOCH_END)
    _timed_batch(monitor, state, fire, clock, data_s=1.0, forward_backward_s=1.0, optimizer_s=1.0, other_s=1.0)
    assert recorder.last("time/phase/data_s") == 1.0


def test_per_dtype_peak_override_gives_mfu(state, recorder, clock, fire, train_batch, flops_model):
    state.model = flops_model(flops_per_batch=100)
    state.precision = "amp_bf16"
    monitor = _monitor(clock, window_size=1, gpu_flops_available={"bf16": 1000.0})
    fire(monitor, Event.FIT_START)
    clock.now = 1.0
    train_batch(monitor)
    assert recorder.last("throughput/device/mfu") == 0.1


def test_yaml_peak_override_per_dtype_is_coerced_to_floats():
    cls = registry.callbacks.get("speed_monitor")
    kwargs = check_call_kwargs(cls, {"gpu_flops_available": {"bf16": "989.5e12"}}, "callbacks.speed_monitor")
    assert kwargs == {"gpu_flops_available": {"bf16": 989.5e12}}


def test_window_size_below_one_is_a_config_error():
    with pytest.raises(ConfigError, match="window_size"):
        SpeedMonitor(window_size=0)


def test_yaml_kwargs_are_checked_against_the_signature():
    cls = registry.callbacks.get("speed_monitor")
    assert check_call_kwargs(cls, {"window_size": 10}, "callbacks.speed_monitor") == {"window_size": 10}
    with pytest.raises(ConfigError, match="window_size"):
        check_call_kwargs(cls, {"window_sise": 10}, "callbacks.speed_monitor")


def test_run_averages_leave_out_the_warmup_batches(state, recorder, clock, fire, train_batch, flops_model):
    state.model = flops_model(flops_per_batch=100)
    monitor = SpeedMonitor(window_size=2, gpu_flops_available=1000.0, warmup_batches=2, clock=clock)
    fire(monitor, Event.FIT_START)
    for second in (30.0, 32.0, 33.0, 34.0, 36.0):  # a 30 s first batch (compile), a 2 s second, then 1, 1, 2
        clock.now = second
        train_batch(monitor, samples=4, tokens=40)
    fire(monitor, Event.FIT_END)
    metrics, _ = recorder.calls[-1]
    assert metrics["throughput/run/batches"] == 3
    assert metrics["time/first_batch_s"] == 30.0
    assert metrics["throughput/run/tokens_per_sec"] == 30.0  # 3 batches of 40 tokens in 4 s
    assert metrics["throughput/run/device/mfu"] == 0.075  # 300 FLOPs / 4 s / 1000


def test_run_averages_of_a_fit_shorter_than_the_warmup_cover_every_batch(recorder, clock, fire, train_batch):
    monitor = SpeedMonitor(window_size=5, warmup_batches=2, clock=clock)
    fire(monitor, Event.FIT_START)
    clock.now = 4.0
    train_batch(monitor, samples=4, tokens=40)
    fire(monitor, Event.FIT_END)
    metrics, _ = recorder.calls[-1]
    assert metrics["throughput/run/batches"] == 1 and metrics["throughput/run/tokens_per_sec"] == 10.0
    assert "throughput/run/device/mfu" not in metrics  # no peak on a CPU


def test_negative_warmup_batches_is_a_config_error(clock):
    with pytest.raises(ConfigError, match="warmup_batches is -1"):
        SpeedMonitor(warmup_batches=-1, clock=clock)
