"""What a person watching the run sees: a progress bar or periodic lines, eval results, a final summary."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from tqdm import tqdm

from foundry import registry
from foundry.core.callback import LoggerDestination
from foundry.core.event import Event
from foundry.core.interval import Interval
from foundry.core.logger import Logger
from foundry.core.paths import public_location
from foundry.core.state import State
from foundry.core.time import SECONDS_PER_UNIT, Time, Timestamp, TimeUnit

TRAIN_LOSS_KEY = "loss/train/total"
PREFERENCE_KEYS = ("rewards/accuracies", "rewards/margins")  # preference tuning's progress (foundry.preference)
# Short names keep the bar's postfix on one terminal line.
_BAR_NAMES = {
    TRAIN_LOSS_KEY: "loss",
    "throughput/tokens_per_sec": "tok/s",
    "throughput/device/mfu": "mfu",
    "time/remaining_estimate": "eta",
}


@registry.loggers.register("console")
class ConsoleLogger(LoggerDestination):
    """Prints training progress on rank 0.

    On an interactive terminal (or with ``progress_bar=True``) a tqdm bar over the run's batches
    carries loss, lr and tokens/s (the loss as each batch logs it, the rest refreshed every
    ``log_interval``); otherwise a line is printed every ``log_interval``, e.g.
    ``[batch 20/200] loss/train/total: 3.2107 lr: 6.0e-04 throughput/tokens_per_sec: 1.2e+04``.
    Eval metrics (``metrics/...``) are printed when logged, and FIT_END prints a summary with the
    first and last train and eval losses.

    Args:
        log_interval: How often to print a line or refresh the bar's numbers, e.g. '10ba'.
        progress_bar: Force the bar on or off; None shows it only on an interactive terminal.
        stream: Where to print; the current ``sys.stdout`` if None.
        clock: Seconds from an arbitrary origin, for the summary's wall time; injectable for tests.
    """

    def __init__(
        self,
        log_interval: str | int | Time = "1ba",
        progress_bar: bool | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.log_interval = Interval(log_interval)
        self.progress_bar = progress_bar
        self._stream = stream
        self.clock = clock
        self._rank = int(os.environ.get("RANK", "0"))  # until an event tells us state.rank
        self._latest: dict[str, float] = {}  # last value of every metric seen
        self._first: dict[str, float] = {}  # first value of the losses the summary reports
        self._remaining_unit_s = SECONDS_PER_UNIT["hours"]  # the runtime estimator's unit
        self._last_check: Timestamp | None = None  # the timestamp at the previous interval check
        # A due line waits for its batch's train loss, which the Trainer logs just after BATCH_END;
        # any later event prints it with whatever has arrived.
        self._due_position: str | None = None  # e.g. '20/200'
        self._due_step = -1
        self._loss_step = -1
        self._bar: tqdm | None = None
        self._fit_start_s = 0.0
        self._saved_checkpoint: str | None = None  # the newest checkpoint this run wrote (not one it loaded)

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        self._rank = state.rank
        if event != Event.BATCH_END:
            self._print_due()
        super().run_event(event, state, logger)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        unit = hyperparameters.get("time/remaining_estimate_unit")
        if unit in SECONDS_PER_UNIT:
            self._remaining_unit_s = SECONDS_PER_UNIT[unit]

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._latest.update(metrics)
        for key, value in metrics.items():
            if _is_summary_loss(key):
                self._first.setdefault(key, value)
        if TRAIN_LOSS_KEY in metrics:
            self._loss_step = step
            if step == self._due_step:
                self._print_due()
            elif self._bar is not None:  # the bar shows the newest loss, not the one of the last interval
                self._bar.set_postfix(ordered_dict=self._bar_values(), refresh=True)
        eval_metrics = {key: value for key, value in metrics.items() if _is_eval_line_metric(key)}
        if eval_metrics:
            self._write(f"[eval @ batch {step}] " + _join({key: f"{v:.4f}" for key, v in eval_metrics.items()}))

    def log_text(self, text: str) -> None:
        self._write(text)

    def fit_start(self, state: State, logger: Logger) -> None:
        self._fit_start_s = self.clock()
        self._last_check = state.timestamp
        show_bar = self.progress_bar if self.progress_bar is not None else self.stream.isatty()
        if show_bar and state.rank == 0:
            total = total_batches(state)
            start = state.timestamp.batch
            self._bar = tqdm(total=total, initial=start, unit="ba", file=self.stream, dynamic_ncols=True)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._bar is not None:
            self._bar.update(state.timestamp.batch - self._bar.n)
        self._on_interval(state, epoch_end=False)

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._on_interval(state, epoch_end=True)  # epoch-unit intervals are crossed here, not at BATCH_END

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._saved_checkpoint = state.last_checkpoint_path  # fired once the checkpoint is published

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._saved_checkpoint = state.last_checkpoint_path

    def fit_end(self, state: State, logger: Logger) -> None:
        self._close_bar()
        self._write(self.summary(state, self.clock() - self._fit_start_s))

    def close(self) -> None:
        self._close_bar()

    def summary(self, state: State, wall_s: float) -> str:
        """The end-of-fit table: how far the run went and how far the losses fell."""
        rows = [
            ("batches", f"{state.timestamp.batch:,}"),
            ("tokens", f"{state.timestamp.token:,}"),
            ("wall time", format_duration(wall_s)),
        ]
        if "throughput/run/tokens_per_sec" in self._latest:
            rows.append(("throughput", self._run_throughput()))
        for key in sorted(self._first, key=lambda k: (k != TRAIN_LOSS_KEY, k)):
            rows.append((key, f"{self._first[key]:.4f} (first) -> {self._latest[key]:.4f} (last)"))
        if self._saved_checkpoint:  # a checkpoint the run started from is not one it produced
            rows.append(("checkpoint", public_location(self._saved_checkpoint)))  # s3://..., not the local copy
        width = max(len(name) for name, _ in rows)
        return "\n".join(["Run summary"] + [f"  {name:<{width}}  {value}" for name, value in rows])

    def _run_throughput(self) -> str:
        """The speed monitor's steady-state averages: '61,230 tokens/s, MFU 57.6% (batches 3-40; first 48.2s)'."""
        latest = self._latest
        text = f"{latest['throughput/run/tokens_per_sec']:,.0f} tokens/s"
        if "throughput/run/device/mfu" in latest:
            text += f", MFU {latest['throughput/run/device/mfu']:.1%}"
        batches = int(latest.get("throughput/run/batches", 0))
        first_s = latest.get("time/first_batch_s")
        first = f"; the first took {format_duration(first_s)}" if first_s is not None else ""
        return f"{text} (average over the last {batches:,} batch{'es' if batches != 1 else ''}{first})"

    def _on_interval(self, state: State, epoch_end: bool) -> None:
        previous, self._last_check = self._last_check, state.timestamp
        if not self.log_interval.due(state, epoch_end, since=previous):
            return
        total = total_batches(state)
        self._due_step = state.timestamp.batch
        self._due_position = f"{self._due_step}/{total}" if total else f"{self._due_step}"
        if self._loss_step == self._due_step:  # the loss came before BATCH_END
            self._print_due()

    def _print_due(self) -> None:
        if self._due_position is None:
            return
        values = self._progress_values()
        if self._bar is not None:
            # Redrawn now: the bar last drew at BATCH_END, before this batch's loss arrived.
            self._bar.set_postfix(ordered_dict=self._bar_values(values), refresh=True)
        else:
            self._write(f"[batch {self._due_position}] {_join(values)}")
        self._due_position, self._due_step = None, -1

    def _bar_values(self, values: dict[str, str] | None = None) -> dict[str, str]:
        return {_BAR_NAMES.get(k, k): v for k, v in (values or self._progress_values()).items()}

    def _progress_values(self) -> dict[str, str]:
        """The few numbers worth a glance, formatted: train losses, lr, tokens/s, MFU, ETA."""
        values = {
            key: f"{value:.4f}"
            for key, value in sorted(self._latest.items())
            if key.startswith("loss/train/") or key in PREFERENCE_KEYS
        }
        lr_key = next((key for key in self._latest if key.startswith("lr-")), None)
        if lr_key is not None:
            values["lr"] = f"{self._latest[lr_key]:.1e}"
        if "throughput/tokens_per_sec" in self._latest:
            values["throughput/tokens_per_sec"] = f"{self._latest['throughput/tokens_per_sec']:.1e}"
        if "throughput/device/mfu" in self._latest:
            values["throughput/device/mfu"] = f"{self._latest['throughput/device/mfu']:.3f}"
        if "time/remaining_estimate" in self._latest:
            remaining_s = self._latest["time/remaining_estimate"] * self._remaining_unit_s
            values["time/remaining_estimate"] = format_duration(remaining_s)
        return values

    def _write(self, text: str) -> None:
        if self._rank != 0:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def total_batches(state: State) -> int | None:
    """Batches in the whole run when ``max_duration`` says so exactly; None for token/sample durations."""
    duration = state.max_duration
    if duration.unit == TimeUnit.BATCH:
        return int(duration.value)
    if duration.unit == TimeUnit.EPOCH and state.train_dataloader_len:
        return int(duration.value) * state.train_dataloader_len
    return None


def format_duration(seconds: float) -> str:
    """'1h02m03s', '2m13s' or '4.2s'."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


# LLM Foundry's names for the train metrics, and for the eval loss and perplexity the line already shows: they
# reach metrics.jsonl and the other loggers, not the console (docs/LOGGING.md).
_NOT_ON_THE_EVAL_LINE = ("/LanguageCrossEntropy", "/LanguagePerplexity")


def _is_eval_line_metric(key: str) -> bool:
    return (
        key.startswith("metrics/") and not key.startswith("metrics/train/") and not key.endswith(_NOT_ON_THE_EVAL_LINE)
    )


def _is_summary_loss(key: str) -> bool:
    return key == TRAIN_LOSS_KEY or (key.startswith("metrics/") and key.endswith("/loss"))


def _join(values: dict[str, str]) -> str:
    return " ".join(f"{key}: {value}" for key, value in values.items())
