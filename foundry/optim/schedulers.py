"""Learning-rate schedules written in training time (``"100ba"``, ``"0.1dur"``), computed as Composer computes them.

A schedule is a function of the run's timestamp that returns a multiplier of each param group's
initial LR: for each name, the same function as Composer's scheduler of that name, to the last bit.
Times convert as Composer converts them (``absolute_time``): ``dur`` to whole units of
``max_duration`` (rounded down), epochs to batches. The Trainer steps the schedules before the
timestamp counts the batch just trained, as Composer's Trainer does, so batch k + 1 trains at the
LR of k batches done (batches 0 and 1 both at LR(0)); the LR monitor logs that LR at BATCH_END.
The result is stateless, so resuming from a checkpoint recomputes the same LR from the timestamp.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from foundry import registry
from foundry.core.time import Time, TimeUnit
from foundry.errors import ConfigError

if TYPE_CHECKING:
    from foundry.core.state import State


class TimeScheduler:
    """Base class: ``multiplier(state)`` gives the LR factor at ``state``'s timestamp."""

    def multiplier(self, state: State) -> float:
        raise NotImplementedError

    def to_torch(self, optimizer: torch.optim.Optimizer, state: State) -> torch.optim.lr_scheduler.LambdaLR:
        """A torch scheduler the Trainer steps once per batch; LR = initial LR × multiplier(state)."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: self.multiplier(state))


def absolute_time(time: Time, state: State) -> Time:
    """``time`` in a unit the timestamp counts (Composer's ``_convert_time``).

    ``dur`` becomes whole units of ``max_duration``, rounded down (``"0.05dur"`` of ``"30ba"`` is 1ba),
    or batches when ``max_duration`` is in epochs; epochs become batches.
    """
    max_duration = state.max_duration
    if time.unit == TimeUnit.DURATION:
        if max_duration.unit == TimeUnit.EPOCH:
            return Time(int(time.value * _batches_per_epoch(time, state) * max_duration.value), TimeUnit.BATCH)
        return Time(int(time.value * max_duration.value), max_duration.unit)
    if time.unit == TimeUnit.EPOCH:
        return Time(time.value * _batches_per_epoch(time, state), TimeUnit.BATCH)
    return time


def _batches_per_epoch(time: Time, state: State) -> int:
    if not state.train_dataloader_len:
        raise ConfigError(
            f"Scheduler time {time} needs the batches per epoch, which this train loader does not state (it has "
            f"no len()). Write the scheduler's times in batches or tokens, or max_duration ({state.max_duration}) "
            "in them."
        )
    return state.train_dataloader_len


def _check_same_unit(warmup: Time, end: Time, state: State) -> None:
    """Composer subtracts one from the other, which it refuses across units; so does foundry, from the first batch."""
    if warmup.unit != end.unit:
        raise ConfigError(
            f"Cannot relate scheduler time {warmup} to t_max {end} (max_duration {state.max_duration}): write "
            f"t_warmup in '{end.unit.value}' or as a fraction of the run ('0.05dur'), or max_duration in "
            f"'{warmup.unit.value}'."
        )


@registry.schedulers.register("constant")
class ConstantScheduler(TimeScheduler):
    """``alpha`` × initial LR for the first ``t_max`` of the run, then the initial LR."""

    def __init__(self, alpha: float = 1.0, t_max: Time | str = "1dur") -> None:
        self.alpha = alpha
        self.t_max = Time.parse(t_max)

    def multiplier(self, state: State) -> float:
        end = absolute_time(self.t_max, state)
        return self.alpha if state.timestamp.get(end.unit) < end.value else 1.0


class _WarmupScheduler(TimeScheduler):
    """Linear warmup from 0 to ``peak`` over ``t_warmup``, then ``decay(fraction of the rest, up to t_max)``."""

    peak = 1.0

    def __init__(self, t_warmup: Time | str, t_max: Time | str = "1dur") -> None:
        self.t_warmup = Time.parse(t_warmup)
        self.t_max = Time.parse(t_max)

    def decay(self, fraction: float) -> float:
        raise NotImplementedError

    def multiplier(self, state: State) -> float:
        warmup, end = absolute_time(self.t_warmup, state), absolute_time(self.t_max, state)
        _check_same_unit(warmup, end, state)
        now = state.timestamp.get(warmup.unit)
        if now < warmup.value:
            return min(1.0, now / warmup.value) * self.peak
        fraction = min(1.0, (now - warmup.value) / (end.value - warmup.value)) if end.value > warmup.value else 0.0
        return self.decay(fraction)


@registry.schedulers.register("constant_with_warmup")
class ConstantWithWarmupScheduler(_WarmupScheduler):
    """Warmup to ``alpha``, then ``alpha``."""

    def __init__(self, t_warmup: Time | str, alpha: float = 1.0, t_max: Time | str = "1dur") -> None:
        super().__init__(t_warmup, t_max)
        self.alpha = self.peak = alpha

    def decay(self, fraction: float) -> float:
        return self.alpha


@registry.schedulers.register("cosine_with_warmup")
class CosineWithWarmupScheduler(_WarmupScheduler):
    """Warmup, then half a cosine from 1 down to ``alpha_f`` at ``t_max``."""

    def __init__(self, t_warmup: Time | str, alpha_f: float = 0.0, t_max: Time | str = "1dur") -> None:
        super().__init__(t_warmup, t_max)
        self.alpha_f = alpha_f

    def decay(self, fraction: float) -> float:
        return self.alpha_f + (1.0 - self.alpha_f) * (1 + math.cos(fraction * math.pi)) / 2


@registry.schedulers.register("linear_decay_with_warmup")
class LinearWithWarmupScheduler(_WarmupScheduler):
    """Warmup to ``alpha_i``, then a straight line from ``alpha_i`` down to ``alpha_f`` at ``t_max``."""

    def __init__(
        self, t_warmup: Time | str, alpha_i: float = 1.0, alpha_f: float = 0.0, t_max: Time | str = "1dur"
    ) -> None:
        super().__init__(t_warmup, t_max)
        self.alpha_i = self.peak = alpha_i
        self.alpha_f = alpha_f

    def decay(self, fraction: float) -> float:
        return self.alpha_i + fraction * (self.alpha_f - self.alpha_i)
