"""Hold a run's train loss against a reference run's, by tokens, while it trains: warn or stop when it strays.

What a user wants after moving a run to new hardware (``hand_over``), a new precision or a new version:
the reference is a finished (or longer) run of the same model and data, read from its metrics.jsonl;
``foundry compare`` gives the same verdict afterwards, for the whole curve. A run that ``action: stop``
ended exits ``foundry train`` with ``EXIT_CHECK_FAILED`` (1), as a failed ``foundry compare`` does.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Literal

from foundry import distributed, registry
from foundry.convergence import DEFAULT_MAX_FACTOR, DEFAULT_TOLERANCE, TRAIN_LOSS, interpolate, loss_curves
from foundry.core.callback import Callback
from foundry.core.interval import Interval
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.core.time import Time
from foundry.errors import ConfigError, DataError


@registry.callbacks.register("reference_curve")
class ReferenceCurve(Callback):
    """Every ``interval``, compare the batch's train loss with the reference's at the same tokens trained.

    A loss further than ``tolerance`` from the reference is out of the band: ``action: warn`` warns (and
    logs the text) when the run leaves the band and again if it comes back and leaves again; ``action:
    stop`` ends the run there, with a stop reason naming the batch. ``reference/abs_diff`` is logged at
    each check. Points beyond the reference's last token are not checked.

    Each check reads the loss on the host (one sync, plus an all-reduce of one number on several ranks):
    on a GPU keep ``interval`` at a few batches or at the console's interval.

    Args:
        reference: the reference run folder, or its metrics.jsonl.
        tolerance: |Δ loss| allowed at a single check; default 0.1, the largest single-point gap
            ``foundry compare`` allows by default (docs/CONVERGENCE.md).
        action: ``warn`` or ``stop``.
        interval: how often to check, e.g. ``10ba``.
    """

    def __init__(
        self,
        reference: str,
        tolerance: float = DEFAULT_TOLERANCE * DEFAULT_MAX_FACTOR,
        action: Literal["warn", "stop"] = "warn",
        interval: str | Time = "1ba",
    ) -> None:
        if tolerance <= 0:
            raise ConfigError(f"callbacks.reference_curve.tolerance is {tolerance}; it must be positive.")
        if action not in ("warn", "stop"):
            raise ConfigError(f"callbacks.reference_curve.action is {action!r}; use 'warn' or 'stop'.")
        try:
            curve = loss_curves(reference).get(TRAIN_LOSS)
        except DataError as error:
            raise ConfigError(f"callbacks.reference_curve.reference: {error}") from None
        if not curve:
            raise ConfigError(
                f"callbacks.reference_curve.reference: {reference} holds no {TRAIN_LOSS}; point it at the metrics "
                "of a run of the same model and data."
            )
        self.reference = str(Path(reference))
        self.curve = curve
        self.tolerance = tolerance
        self.action = action
        self.interval = Interval(interval)
        self.outside = False
        self.excursions: list[int] = []  # the batches at which the run left the band
        self.stopped_at: int | None = None  # the batch at which action 'stop' ended this launch

    def batch_start(self, state: State, logger: Logger) -> None:
        self.interval.mark(state)

    def batch_end(self, state: State, logger: Logger) -> None:
        if state.loss is None or not self.interval.due(state):
            return
        tokens = state.timestamp.token
        expected = interpolate(self.curve, float(tokens))
        if expected is None:  # past the reference's end (every rank at the same tokens: all return here)
            return
        summed = distributed.all_reduce_sum(state.loss.detach().float().reshape(()).clone())
        loss = summed.item() / state.world_size
        difference = abs(loss - expected)
        logger.log_metrics({"reference/abs_diff": difference})
        outside = not math.isfinite(loss) or difference > self.tolerance
        if outside and not self.outside:
            self._left_band(state, logger, loss, expected, tokens)
        self.outside = outside

    def _left_band(self, state: State, logger: Logger, loss: float, expected: float, tokens: int) -> None:
        batch = state.timestamp.batch
        self.excursions.append(batch)
        text = (
            f"reference_curve: at batch {batch} ({tokens:,} tokens) the train loss {loss:.4f} is "
            f"{abs(loss - expected):.4f} from the reference's {expected:.4f} ({self.reference}), outside the band "
            f"of {self.tolerance:g}."
        )
        logger.log_text(text)
        if self.action == "stop":
            state.stop_reason = text
            self.stopped_at = batch
        else:
            warnings.warn(text, stacklevel=2)

    def state_dict(self) -> dict:
        return {"outside": self.outside, "excursions": list(self.excursions)}

    def load_state_dict(self, state: dict) -> None:
        self.outside = bool(state.get("outside", False))
        self.excursions = [int(batch) for batch in state.get("excursions", [])]


def stopped_outside_band(callbacks: list[Callback]) -> bool:
    """Whether a ``ReferenceCurve`` among ``callbacks`` stopped this launch (the run left the reference's band)."""
    return any(isinstance(callback, ReferenceCurve) and callback.stopped_at is not None for callback in callbacks)
