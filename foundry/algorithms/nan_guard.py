"""Stop (or step past) a batch whose loss or gradients are NaN/inf before it moves the weights; flag loss spikes."""

from __future__ import annotations

import math
import warnings
from collections import deque
from typing import Any, Literal

import torch

from foundry import distributed, registry
from foundry.callbacks.optimizer_monitor import grad_norm_of_batch
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.paths import public_location
from foundry.core.state import State
from foundry.errors import ConfigError, TrainingError

Mode = Literal["stop", "skip"]


@registry.algorithms.register("nan_guard")
class NanGuard(Algorithm):
    """Checks every batch at BEFORE_OPTIMIZER_STEP: the gradients are complete and no weight has moved yet.

    An algorithm, not a callback: it changes the run (drops a batch's update, or ends the run). List it
    after ``gradient_clipping`` so that it reuses the norm clipping computed.

    The batch loss and (with ``check_grads``) the global grad norm are read with ONE host sync per
    batch (plus, on several ranks, one all-reduce of two floats so every rank decides alike). Batches
    are numbered as the console numbers them: the first batch of the run is batch 1.

    - ``mode: stop`` raises ``TrainingError`` naming the batch. Nothing was applied and the Trainer
      does not checkpoint on an error, so every checkpoint on disk predates the bad batch.
    - ``mode: skip`` drops the batch's update, warns, logs ``health/skipped_batches`` (a running
      count), and raises at a bad batch that follows ``max_skipped_batches`` skipped ones in a row.

    A loss above ``spike_factor`` times the mean of the last ``spike_window`` finite losses is a
    spike: a warning (python and ``logger.log_text``) and ``health/loss_spikes``, nothing else. The
    default 2.0 stays silent on the batch-to-batch noise of small fine-tuning batches (rarely 1.5x
    the mean) while still catching a divergence; a falling curve never fires.

    Under ``amp_fp16`` the GradScaler already skips steps with inf/NaN gradients (they are how it
    finds its scale), so only the loss is checked.

    Args:
        mode: 'stop' or 'skip'.
        check_grads: Also check the global grad norm (reuses gradient_clipping's when it computed one).
        max_skipped_batches: In skip mode, consecutive skipped batches after which the next bad one ends the run.
        spike_factor: Loss over this multiple of the recent mean is a spike; None turns spike warnings off.
        spike_window: Recent finite losses the mean is taken over; no warning before the window is full.
    """

    def __init__(
        self,
        mode: Mode = "stop",
        check_grads: bool = True,
        max_skipped_batches: int = 10,
        spike_factor: float | None = 2.0,
        spike_window: int = 50,
    ) -> None:
        if mode not in ("stop", "skip"):
            raise ConfigError(f"algorithms.nan_guard.mode is {mode!r}; use 'stop' or 'skip'.")
        if max_skipped_batches < 1:
            raise ConfigError(f"algorithms.nan_guard.max_skipped_batches is {max_skipped_batches}; it must be >= 1.")
        if spike_factor is not None and spike_factor <= 1.0:
            raise ConfigError(f"algorithms.nan_guard.spike_factor is {spike_factor}; use a factor above 1 (e.g. 2.0).")
        if spike_window < 1:
            raise ConfigError(f"algorithms.nan_guard.spike_window is {spike_window}; it must be >= 1.")
        self.mode = mode
        self.check_grads = check_grads
        self.max_skipped_batches = max_skipped_batches
        self.spike_factor = spike_factor
        self.recent_losses: deque[float] = deque(maxlen=spike_window)
        self.skipped_batches = 0
        self.loss_spikes = 0
        self._skipped_in_a_row = 0

    def match(self, event: Event, state: State) -> bool:
        return event == Event.BEFORE_OPTIMIZER_STEP and state.loss is not None

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        batch = state.timestamp.batch + 1  # the batch being trained, as the console numbers it
        loss, grad_norm = self._read_loss_and_grad_norm(state)
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._on_non_finite(state, logger, batch, loss, grad_norm)
            return
        self._skipped_in_a_row = 0
        self._check_spike(logger, batch, loss)
        self.recent_losses.append(loss)

    def _read_loss_and_grad_norm(self, state: State) -> tuple[float, float]:
        """The mean loss over ranks and the global grad norm (0.0 when not checked), with one host sync."""
        values = [state.loss.detach().float().reshape(())]
        if self._checks_grads(state):
            values.append(grad_norm_of_batch(state).to(values[0].device).reshape(()))
        else:
            values.append(torch.zeros_like(values[0]))
        # The grad norm is already global; summing it over ranks and dividing keeps it (and keeps one collective).
        summed = distributed.all_reduce_sum(torch.stack(values)) / state.world_size
        loss, grad_norm = summed.tolist()
        return loss, grad_norm

    def _checks_grads(self, state: State) -> bool:
        return self.check_grads and state.precision != "amp_fp16"

    def _on_non_finite(self, state: State, logger: Logger, batch: int, loss: float, grad_norm: float) -> None:
        culprit = "loss" if not math.isfinite(loss) else "gradients (the loss is finite)"
        if self.mode == "stop":
            raise TrainingError(self._stop_message(state, batch, culprit, loss, grad_norm))
        if self._skipped_in_a_row >= self.max_skipped_batches:
            raise TrainingError(
                f"nan_guard: the {culprit} became non-finite at batch {batch} after {self._skipped_in_a_row} "
                f"skipped batches in a row (algorithms.nan_guard.max_skipped_batches: {self.max_skipped_batches}), "
                "so skipping does not help; no weights changed at this batch. " + _advice(batch)
            )
        self._skipped_in_a_row += 1
        state.skip_optimizer_step = True
        self.skipped_batches += 1
        text = (
            f"nan_guard: skipped batch {batch}: the {culprit} became non-finite (loss {loss:.4g}, grad norm "
            f"{grad_norm:.4g}); its update was dropped ({self._skipped_in_a_row} in a row)."
        )
        warnings.warn(text, stacklevel=2)
        logger.log_text(text)
        logger.log_metrics({"health/skipped_batches": self.skipped_batches}, step=batch)

    def _stop_message(self, state: State, batch: int, culprit: str, loss: float, grad_norm: float) -> str:
        norm_text = f"grad norm {grad_norm:.4g}" if self._checks_grads(state) else "grad norm not checked"
        newest = state.last_checkpoint_path
        checkpoint = f" The newest checkpoint is {public_location(newest)}." if newest else ""
        return (
            f"nan_guard: the {culprit} became non-finite at batch {batch} (loss {loss:.4g}, {norm_text}). "
            f"Training stopped before the optimizer step: no weights changed and no checkpoint holds batch "
            f"{batch}.{checkpoint} " + _advice(batch)
        )

    def _check_spike(self, logger: Logger, batch: int, loss: float) -> None:
        window = self.recent_losses
        if self.spike_factor is None or len(window) < (window.maxlen or 0):
            return
        mean = sum(window) / len(window)
        if mean <= 0 or loss <= self.spike_factor * mean:
            return
        self.loss_spikes += 1
        text = (
            f"nan_guard: loss spike at batch {batch}: {loss:.4f} is {loss / mean:.1f}x the mean of the last "
            f"{len(window)} batches ({mean:.4f})."
        )
        warnings.warn(text, stacklevel=2)
        logger.log_text(text)
        logger.log_metrics({"health/loss_spikes": self.loss_spikes}, step=batch)

    def state_dict(self) -> dict[str, Any]:
        return {
            "skipped_batches": self.skipped_batches,
            "loss_spikes": self.loss_spikes,
            "recent_losses": list(self.recent_losses),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_batches = int(state.get("skipped_batches", 0))
        self.loss_spikes = int(state.get("loss_spikes", 0))
        self.recent_losses.clear()
        self.recent_losses.extend(float(loss) for loss in state.get("recent_losses", []))


def _advice(batch: int) -> str:
    return (
        "To try: a lower learning rate (optimizer.lr), gradient clipping (algorithms: {gradient_clipping: "
        "{clipping_threshold: 1.0}}), precision: amp_bf16 instead of amp_fp16, and a look at the data of "
        f"batch {batch}; algorithms.nan_guard.mode: skip steps past isolated bad batches."
    )
