"""End training from eval metrics: when one stops improving (early_stopper) or crosses a threshold (threshold_stopper).

Both read ``state.eval_metrics`` at EVAL_END (no host sync: eval already brought the values to the
host) and stop through ``state.stop_reason``, so fit() ends after the current batch with its usual
final eval and checkpoint. Names and semantics follow Composer's EarlyStopper and ThresholdStopper.
"""

from __future__ import annotations

from typing import Any, Literal

from foundry import registry
from foundry.core.callback import Callback
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.core.time import Time, Timestamp
from foundry.errors import ConfigError, did_you_mean

Comparison = Literal["auto", "min", "max"]
_LOWER_IS_BETTER = ("loss", "perplexity", "error", "entropy")  # comparison: auto (LanguageCrossEntropy too)


class _EvalMetricStopper(Callback):
    """Which eval metric to watch, which direction is better, and its fresh value at each EVAL_END."""

    yaml_name = ""

    def __init__(self, monitor: str, dataloader_label: str | None, comparison: Comparison) -> None:
        if comparison not in ("auto", "min", "max"):
            raise ConfigError(f"callbacks.{self.yaml_name}.comparison is {comparison!r}; use 'auto', 'min' or 'max'.")
        self.label, self.metric = self._split_monitor(monitor, dataloader_label)
        self.key = f"metrics/{self.label}/{self.metric}"
        if comparison == "auto":
            comparison = "min" if any(word in self.metric.lower() for word in _LOWER_IS_BETTER) else "max"
        self.lower_is_better = comparison == "min"
        self._seen_metrics: dict[str, float] | None = None

    def _split_monitor(self, monitor: str, dataloader_label: str | None) -> tuple[str, str]:
        """'metrics/<label>/<name>', or Composer's form: monitor '<name>' plus dataloader_label."""
        if not monitor.startswith("metrics/"):
            return dataloader_label or "eval", monitor
        parts = monitor.split("/", 2)
        if len(parts) != 3 or not parts[1] or not parts[2]:
            raise ConfigError(
                f"callbacks.{self.yaml_name}.monitor is '{monitor}'; write 'metrics/<eval label>/<metric>' "
                "(e.g. 'metrics/eval/loss') or the metric name alone with dataloader_label."
            )
        if dataloader_label is not None and dataloader_label != parts[1]:
            raise ConfigError(
                f"callbacks.{self.yaml_name}.monitor '{monitor}' names eval loader '{parts[1]}' but dataloader_label "
                f"is '{dataloader_label}'; drop dataloader_label or make them agree."
            )
        return parts[1], parts[2]

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.label not in state.eval_dataloaders:
            labels = ", ".join(state.eval_dataloaders) or "none"
            raise ConfigError(
                f"callbacks.{self.yaml_name} watches '{self.key}', but the run has no eval loader labelled "
                f"'{self.label}' (eval loaders: {labels}).{did_you_mean(self.label, state.eval_dataloaders)} "
                "Stoppers watch eval metrics: set eval_loader (label 'eval') or fix the label."
            )

    def _fresh_value(self, state: State) -> float | None:
        """The watched metric if its loader was just evaluated; None at another loader's EVAL_END."""
        metrics = state.eval_metrics.get(self.label)
        # The Trainer stores a new dict per evaluation, so an unchanged dict means another loader just ran.
        if metrics is None or metrics is self._seen_metrics:
            return None
        self._seen_metrics = metrics
        if self.metric not in metrics:
            available = ", ".join(f"metrics/{self.label}/{name}" for name in metrics)
            raise ConfigError(
                f"callbacks.{self.yaml_name}.monitor '{self.key}' is not an eval metric of this run."
                f"{did_you_mean(self.metric, metrics)} Available: {available}."
            )
        return float(metrics[self.metric])

    def _better(self, value: float, reference: float, margin: float = 0.0) -> bool:
        """Whether ``value`` beats ``reference`` by more than ``margin`` (False for NaN)."""
        return value < reference - margin if self.lower_is_better else value > reference + margin

    def _stop(self, state: State, logger: Logger, reason: str) -> None:
        state.stop_reason = reason
        logger.log_text(reason)


@registry.callbacks.register("early_stopper")
class EarlyStopper(_EvalMetricStopper):
    """Stops when the watched eval metric has not improved for ``patience``.

    An eval improves on the best so far when it beats it by more than ``min_delta``. Training stops at
    the first eval where ``patience`` evals (an int) or that much training time (a Time such as
    '500ba' or '1ep') have passed since the best one.

    Args:
        monitor: 'metrics/<label>/<name>' (e.g. 'metrics/eval/loss'), or Composer's '<name>' with dataloader_label.
        dataloader_label: The eval loader's label, for the Composer form (default 'eval').
        patience: Evals without improvement (int), or a Time since the best eval.
        min_delta: The margin an eval must beat the best by to count as an improvement.
        comparison: 'min' (lower is better), 'max', or 'auto': 'min' when the name holds loss, perplexity or error.
    """

    yaml_name = "early_stopper"

    def __init__(
        self,
        monitor: str = "metrics/eval/loss",
        dataloader_label: str | None = None,
        patience: int | str = 1,
        min_delta: float = 0.0,
        comparison: Comparison = "auto",
    ) -> None:
        super().__init__(monitor, dataloader_label, comparison)
        self.patience = _parse_patience(patience)
        self.min_delta = abs(min_delta)
        self.best: float | None = None
        self.best_at = Timestamp()
        self.evals_since_best = 0

    def eval_end(self, state: State, logger: Logger) -> None:
        value = self._fresh_value(state)
        if value is None:
            return
        if self.best is None or self._better(value, self.best, self.min_delta):
            self.best, self.best_at, self.evals_since_best = value, state.timestamp, 0
            return
        self.evals_since_best += 1
        if self._patience_ran_out(state):
            self._stop(
                state,
                logger,
                f"early_stopper: {self.key} has not improved by more than {self.min_delta:g} for {self._waited(state)} "
                f"(best {self.best:.4f} at batch {self.best_at.batch}, now {value:.4f}); stopping.",
            )

    def _patience_ran_out(self, state: State) -> bool:
        if isinstance(self.patience, int):
            return self.evals_since_best >= self.patience
        patience = state.to_absolute(self.patience)
        return state.timestamp.get(patience.unit) - self.best_at.get(patience.unit) >= patience.value

    def _waited(self, state: State) -> str:
        if isinstance(self.patience, int):
            return f"{self.evals_since_best} evals"
        unit = state.to_absolute(self.patience).unit
        return f"{state.timestamp.get(unit) - self.best_at.get(unit)}{unit.value} (patience {self.patience})"

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_at": self.best_at.state_dict(), "evals_since_best": self.evals_since_best}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state.get("best")
        self.best_at = Timestamp.from_state_dict(state["best_at"]) if "best_at" in state else Timestamp()
        self.evals_since_best = int(state.get("evals_since_best", 0))


@registry.callbacks.register("threshold_stopper")
class ThresholdStopper(_EvalMetricStopper):
    """Stops once the watched eval metric beats ``threshold`` (below it for 'min', above it for 'max').

    Args:
        monitor: 'metrics/<label>/<name>', or Composer's '<name>' with dataloader_label.
        threshold: The value to beat.
        dataloader_label: The eval loader's label, for the Composer form (default 'eval').
        comparison: 'min', 'max', or 'auto' ('min' when the name holds loss, perplexity or error).
        stop_on_batch: Stop after the batch whose eval crossed the threshold; False finishes the epoch first.
    """

    yaml_name = "threshold_stopper"

    def __init__(
        self,
        monitor: str,
        threshold: float,
        dataloader_label: str | None = None,
        comparison: Comparison = "auto",
        stop_on_batch: bool = True,
    ) -> None:
        super().__init__(monitor, dataloader_label, comparison)
        self.threshold = threshold
        self.stop_on_batch = stop_on_batch
        self._reason: str | None = None  # waiting for the epoch's end when not stop_on_batch

    def eval_end(self, state: State, logger: Logger) -> None:
        value = self._fresh_value(state)
        if value is None or self._reason is not None or not self._better(value, self.threshold):
            return
        side = "below" if self.lower_is_better else "above"
        self._reason = (
            f"threshold_stopper: {self.key} is {value:.4f}, {side} the threshold {self.threshold:g}; stopping."
        )
        if self.stop_on_batch:
            self._stop(state, logger, self._reason)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self._reason is not None and state.stop_reason is None:
            self._stop(state, logger, self._reason)


def _parse_patience(patience: int | str) -> int | Time:
    if isinstance(patience, int) and not isinstance(patience, bool):
        if patience < 1:
            raise ConfigError(f"callbacks.early_stopper.patience is {patience}; give at least 1 eval or a time.")
        return patience
    try:
        time = Time.parse(patience)
    except ConfigError as error:
        raise ConfigError(f"callbacks.early_stopper.patience: {error}") from None
    if time.value <= 0:
        raise ConfigError(f"callbacks.early_stopper.patience is '{patience}'; give a positive time such as '500ba'.")
    return time
