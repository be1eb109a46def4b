"""Throughput and model FLOPs utilisation (MFU) over a sliding window of batches.

Timing uses the host clock only: no device synchronize and no ``.item()``, so measuring never slows
the run. With asynchronous CUDA execution a single batch's host time is noisy, but over a window
of batches the host cannot run ahead of the device by more than its queue, so the average is honest.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from foundry import registry
from foundry.callbacks.device_flops import device_peak_flops_per_sec
from foundry.core.callback import Callback
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.errors import ConfigError

SECONDS_PER_HOUR = 3600.0


class TrainClock:
    """Wall-clock seconds spent training, with eval and checkpoint saving left out.

    It runs from FIT_START, stops from EVAL_START to EVAL_END (counted as eval seconds instead),
    and drops the seconds between the last lap (BATCH_END, EVAL_END, EPOCH_END) and a checkpoint
    event, since checkpoint events fire once the file is on disk.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.train_s = 0.0
        self.eval_s = 0.0
        self._lap_start_s: float | None = None  # None while not training (before fit, during eval)
        self._eval_start_s = 0.0
        self._train_resumes_after_eval = False

    def observe(self, event: Event) -> None:
        if event == Event.FIT_START:
            self._lap_start_s = self.clock()
        elif event in (Event.BATCH_END, Event.EPOCH_END, Event.FIT_END):
            self._lap()
        elif event in (Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT) and self._lap_start_s is not None:
            self._lap_start_s = self.clock()
        elif event == Event.EVAL_START:
            self._train_resumes_after_eval = self._lap_start_s is not None
            self._lap()
            self._lap_start_s = None
            self._eval_start_s = self.clock()
        elif event == Event.EVAL_END:
            now = self.clock()
            self.eval_s += now - self._eval_start_s
            self._lap_start_s = now if self._train_resumes_after_eval else None

    def _lap(self) -> None:
        if self._lap_start_s is not None:
            now = self.clock()
            self.train_s += now - self._lap_start_s
            self._lap_start_s = now

    def state_dict(self) -> dict[str, float]:
        return {"train_s": self.train_s, "eval_s": self.eval_s}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_s, self.eval_s = float(state["train_s"]), float(state["eval_s"])


class _BatchRecord(NamedTuple):
    duration_s: float
    samples: int  # whole batch, all ranks (state.batch_num_samples)
    tokens: int  # whole batch, all ranks (state.batch_num_tokens)
    model_flops: int  # per device: forward + backward of the model
    hardware_flops: int  # per device: model flops plus extra work such as activation recompute


@registry.callbacks.register("speed_monitor")
class SpeedMonitor(Callback):
    """Logs throughput over the last ``window_size`` batches, and MFU when the device's peak is known.

    Logged at BATCH_END once ``window_size`` batches are in the window: ``throughput/batches_per_sec``,
    ``throughput/{,device/}samples_per_sec``, ``throughput/{,device/}tokens_per_sec`` (per device is
    the whole batch's count over world size), and when the model reports ``flops_per_batch`` of this
    rank's batch: ``throughput/device/flops_per_sec``, ``throughput/flops_per_sec`` (times world size),
    and, only with a known peak (never on CPU), ``throughput/device/mfu`` and ``throughput/device/hfu``.
    Every BATCH_END also logs ``time/train`` and every EVAL_END ``time/eval``, both in HOURS; eval and
    checkpoint time never count as train time.

    Args:
        window_size: Batches averaged over; the first values appear after this many batches.
        gpu_flops_available: Dense peak FLOP/s of one device; looked up from the device name if None.
        clock: Seconds from an arbitrary origin; injectable for tests.
    """

    def __init__(
        self,
        window_size: int = 100,
        gpu_flops_available: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if window_size < 1:
            raise ConfigError(f"callbacks.speed_monitor.window_size is {window_size}; it must be at least 1.")
        if gpu_flops_available is not None and gpu_flops_available <= 0:
            raise ConfigError(
                f"callbacks.speed_monitor.gpu_flops_available is {gpu_flops_available}; give the device's "
                "peak FLOP/s as a positive number (e.g. 989.5e12), or leave it unset to look it up."
            )
        self.window_size = window_size
        self.gpu_flops_available = gpu_flops_available
        self.train_clock = TrainClock(clock)
        self._window: deque[_BatchRecord] = deque(maxlen=window_size)
        self._train_s_at_last_batch = 0.0
        self._peak_flops_per_sec: float | None = None

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        self.train_clock.observe(event)
        super().run_event(event, state, logger)

    def fit_start(self, state: State, logger: Logger) -> None:
        self._window.clear()
        self._train_s_at_last_batch = self.train_clock.train_s
        self._peak_flops_per_sec = self.gpu_flops_available or device_peak_flops_per_sec(state.device, state.precision)

    def batch_end(self, state: State, logger: Logger) -> None:
        model_flops = model_flops_per_batch(state)
        train_s = self.train_clock.train_s
        self._window.append(
            _BatchRecord(
                duration_s=train_s - self._train_s_at_last_batch,
                samples=state.batch_num_samples,
                tokens=state.batch_num_tokens,
                model_flops=model_flops,
                hardware_flops=model_flops + state.extra_flops_per_batch,
            )
        )
        self._train_s_at_last_batch = train_s
        metrics = {"time/train": train_s / SECONDS_PER_HOUR}
        if len(self._window) == self.window_size:
            metrics.update(self._throughput(state.world_size))
        logger.log_metrics(metrics)

    def eval_end(self, state: State, logger: Logger) -> None:
        logger.log_metrics({"time/eval": self.train_clock.eval_s / SECONDS_PER_HOUR})

    def _throughput(self, world_size: int) -> dict[str, float]:
        duration_s, samples, tokens, model_flops, hardware_flops = (sum(column) for column in zip(*self._window))
        if duration_s <= 0:
            return {}
        metrics = {
            "throughput/batches_per_sec": len(self._window) / duration_s,
            "throughput/samples_per_sec": samples / duration_s,
            "throughput/device/samples_per_sec": samples / world_size / duration_s,
            "throughput/tokens_per_sec": tokens / duration_s,
            "throughput/device/tokens_per_sec": tokens / world_size / duration_s,
        }
        if model_flops > 0:
            device_flops_per_sec = model_flops / duration_s
            metrics["throughput/flops_per_sec"] = device_flops_per_sec * world_size
            metrics["throughput/device/flops_per_sec"] = device_flops_per_sec
            if self._peak_flops_per_sec:
                metrics["throughput/device/mfu"] = device_flops_per_sec / self._peak_flops_per_sec
                metrics["throughput/device/hfu"] = hardware_flops / duration_s / self._peak_flops_per_sec
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return self.train_clock.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_clock.load_state_dict(state)


def model_flops_per_batch(state: State) -> int:
    """``flops_per_batch`` of the model (or of the module a DDP-style wrapper holds); 0 when unknown."""
    model = state.model
    flops_per_batch = getattr(model, "flops_per_batch", None) or getattr(
        getattr(model, "module", None), "flops_per_batch", None
    )
    return int(flops_per_batch(state.batch)) if flops_per_batch is not None else 0
