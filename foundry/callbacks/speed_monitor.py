"""Throughput, model FLOPs utilisation (MFU) and where the time goes, over a sliding window of batches.

Timing uses the host clock only: no device synchronize and no ``.item()``, so measuring never slows
the run. With asynchronous CUDA execution a single batch's host time is noisy, but over a window
of batches the host cannot run ahead of the device by more than its queue, so the average is honest.
The per-phase split is approximate for the same reason: device work shows up in the phase where the
host first waits for it (typically the loss read at a logging step, or the next batch's
forward), not where it was queued; the window's total is exact.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

from foundry import registry
from foundry.callbacks.device_flops import check_peak_override, device_peak_flops_per_sec
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


# Phase name -> (the event that starts it, the events that end it). Time outside every phase (callbacks
# and logging at BATCH_END, waits for the device) is reported as 'other'.
PHASES: dict[str, tuple[Event, tuple[Event, ...]]] = {
    "data": (Event.BEFORE_DATALOADER, (Event.AFTER_DATALOADER,)),
    "forward_backward": (Event.BATCH_START, (Event.BEFORE_OPTIMIZER_STEP,)),
    "optimizer": (Event.BEFORE_OPTIMIZER_STEP, (Event.AFTER_OPTIMIZER_STEP,)),
    "eval": (Event.EVAL_START, (Event.EVAL_END,)),
    "checkpoint": (Event.BEFORE_CHECKPOINT, (Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT)),
}
_TRAIN_PHASES = ("data", "forward_backward", "optimizer")  # the parts of TrainClock's train time
_PHASE_EVENTS = {event for start, ends in PHASES.values() for event in (start, *ends)}


class PhaseClock:
    """Host seconds spent in each of ``PHASES`` since the last ``take()``."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._pending_s = dict.fromkeys(PHASES, 0.0)
        self._started_s: dict[str, float] = {}

    def observe(self, event: Event) -> None:
        if event not in _PHASE_EVENTS:
            return
        now = self.clock()
        for name, (start, ends) in PHASES.items():
            if event in ends and name in self._started_s:
                self._pending_s[name] += now - self._started_s.pop(name)
            elif event == start:  # a start with no end (the epoch's last, empty fetch) is overwritten
                self._started_s[name] = now

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last call, and start again from zero."""
        taken, self._pending_s = self._pending_s, dict.fromkeys(PHASES, 0.0)
        return taken


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

    At FIT_END it logs the averages of the run's steady part, every batch after the first
    ``warmup_batches`` of the fit (which pay for compiling, autotuning and the allocator's first
    growth): ``throughput/run/tokens_per_sec``, ``throughput/run/device/tokens_per_sec``,
    ``throughput/run/device/mfu`` (with a known peak), ``throughput/run/batches`` (how many were
    averaged) and ``time/first_batch_s``. The console's run summary prints them. A fit of no more
    than ``warmup_batches`` batches averages all of them.

    With the throughput, ``time/phase/<phase>_s`` gives the MEAN SECONDS PER BATCH over the window
    spent in each phase: ``data`` (waiting for the loader), ``forward_backward``, ``optimizer`` (the
    step), ``other`` (the rest of train time: BATCH_END callbacks, logging), and, amortised over the
    window, ``eval`` and ``checkpoint`` (charged to the batch after them). data + forward_backward +
    optimizer + other = 1 / batches_per_sec. A boundary is read when this callback sees its event,
    so work done at the same event falls by order: algorithms (gradient clipping) and the callbacks
    listed before speed_monitor count on the earlier side.

    Args:
        window_size: Batches averaged over; the first values appear after this many batches.
        gpu_flops_available: Dense peak FLOP/s of one device, or a map from matmul dtype ('bf16', 'fp16',
            'fp8', 'tf32', 'fp32') to it; what it does not give is looked up from the device name.
        warmup_batches: Batches at the start of each fit left out of the run averages logged at FIT_END.
        clock: Seconds from an arbitrary origin; injectable for tests.
    """

    def __init__(
        self,
        window_size: int = 100,
        gpu_flops_available: float | dict[str, float] | None = None,
        warmup_batches: int = 2,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if window_size < 1:
            raise ConfigError(f"callbacks.speed_monitor.window_size is {window_size}; it must be at least 1.")
        if warmup_batches < 0:
            raise ConfigError(f"callbacks.speed_monitor.warmup_batches is {warmup_batches}; it must be at least 0.")
        self.warmup_batches = warmup_batches
        check_peak_override(gpu_flops_available, "callbacks.speed_monitor.gpu_flops_available")
        self.window_size = window_size
        self.gpu_flops_available = gpu_flops_available
        self.train_clock = TrainClock(clock)
        self.phase_clock = PhaseClock(clock)
        self._window: deque[_BatchRecord] = deque(maxlen=window_size)
        self._phase_window: deque[dict[str, float]] = deque(maxlen=window_size)
        self._train_s_at_last_batch = 0.0
        self._peak_flops_per_sec: float | None = None
        self._fit_batches: list[_BatchRecord] = []  # this fit's batches, for the run averages

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        self.train_clock.observe(event)
        self.phase_clock.observe(event)
        super().run_event(event, state, logger)

    def fit_start(self, state: State, logger: Logger) -> None:
        self._window.clear()
        self._phase_window.clear()
        self.phase_clock.take()  # an eval before fit is not this window's
        self._train_s_at_last_batch = self.train_clock.train_s
        self._peak_flops_per_sec = device_peak_flops_per_sec(state.device, state.precision, self.gpu_flops_available)
        self._fit_batches.clear()

    def batch_end(self, state: State, logger: Logger) -> None:
        model_flops = model_flops_per_batch(state)
        train_s = self.train_clock.train_s
        record = _BatchRecord(
            duration_s=train_s - self._train_s_at_last_batch,
            samples=state.batch_num_samples,
            tokens=state.batch_num_tokens,
            model_flops=model_flops,
            hardware_flops=model_flops + state.extra_flops_per_batch,
        )
        self._window.append(record)
        self._fit_batches.append(record)
        self._phase_window.append(self.phase_clock.take())
        self._train_s_at_last_batch = train_s
        metrics = {"time/train": train_s / SECONDS_PER_HOUR}
        if len(self._window) == self.window_size:
            metrics.update(self._throughput(state.world_size))
            metrics.update(self._phase_means())
        logger.log_metrics(metrics)

    def eval_end(self, state: State, logger: Logger) -> None:
        logger.log_metrics({"time/eval": self.train_clock.eval_s / SECONDS_PER_HOUR})

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._fit_batches:
            logger.log_metrics(self.run_averages(state.world_size))

    def run_averages(self, world_size: int) -> dict[str, float]:
        """Tokens/s and MFU over this fit's batches after the first ``warmup_batches`` (all, if no more ran)."""
        steady = self._fit_batches[self.warmup_batches :] or self._fit_batches
        duration_s = sum(record.duration_s for record in steady)
        metrics = {"throughput/run/batches": len(steady), "time/first_batch_s": self._fit_batches[0].duration_s}
        if duration_s <= 0:
            return metrics
        tokens = sum(record.tokens for record in steady)
        metrics["throughput/run/tokens_per_sec"] = tokens / duration_s
        metrics["throughput/run/device/tokens_per_sec"] = tokens / world_size / duration_s
        model_flops = sum(record.model_flops for record in steady)
        if model_flops > 0 and self._peak_flops_per_sec:
            metrics["throughput/run/device/mfu"] = model_flops / duration_s / self._peak_flops_per_sec
        return metrics

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

    def _phase_means(self) -> dict[str, float]:
        batches = len(self._phase_window)
        totals_s = {name: sum(phases[name] for phases in self._phase_window) for name in PHASES}
        train_s = sum(record.duration_s for record in self._window)
        totals_s["other"] = max(0.0, train_s - sum(totals_s[name] for name in _TRAIN_PHASES))
        return {f"time/phase/{name}_s": total_s / batches for name, total_s in totals_s.items()}

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
