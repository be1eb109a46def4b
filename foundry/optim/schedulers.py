"""Learning-rate schedules written in training time (``"100ba"``, ``"0.1dur"``), not optimizer steps.

A schedule is a function of the run's progress that returns a multiplier of each param group's
initial LR. Everything is computed in *fractions of max_duration*, so warmup in batches and a run
measured in epochs or tokens mix freely; the result is stateless, so resuming from a checkpoint
recomputes the same LR from the timestamp.
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
    """Base class: ``multiplier(state)`` gives the LR factor at ``state``'s progress."""

    def multiplier(self, state: State) -> float:
        raise NotImplementedError

    def to_torch(self, optimizer: torch.optim.Optimizer, state: State) -> torch.optim.lr_scheduler.LambdaLR:
        """A torch scheduler the Trainer steps once per batch; LR = initial LR × multiplier(state)."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: self.multiplier(state))


def duration_fraction(time: Time, state: State) -> float:
    """``time`` as a fraction of ``max_duration`` (``"100ba"`` of a ``"1000ba"`` run is 0.1)."""
    if time.unit == TimeUnit.DURATION:
        return float(time.value)
    max_duration = state.max_duration
    if max_duration.value == 0:
        return 0.0
    if time.unit == max_duration.unit:
        return time.value / max_duration.value
    batches_per_epoch = state.train_dataloader_len
    if {time.unit, max_duration.unit} == {TimeUnit.BATCH, TimeUnit.EPOCH} and batches_per_epoch:
        in_batches = time.value * (batches_per_epoch if time.unit == TimeUnit.EPOCH else 1)
        max_batches = max_duration.value * (batches_per_epoch if max_duration.unit == TimeUnit.EPOCH else 1)
        return in_batches / max_batches
    raise ConfigError(
        f"Cannot relate scheduler time {time} to max_duration {max_duration}: write the scheduler's times in "
        f"'{max_duration.unit.value}' or as a fraction of the run ('0.05dur')."
    )


@registry.schedulers.register("constant")
class ConstantScheduler(TimeScheduler):
    """``alpha`` × initial LR for the first ``t_max`` of the run, then the initial LR."""

    def __init__(self, alpha: float = 1.0, t_max: Time | str = "1dur") -> None:
        self.alpha = alpha
        self.t_max = Time.parse(t_max)

    def multiplier(self, state: State) -> float:
        return self.alpha if state.progress < duration_fraction(self.t_max, state) else 1.0


class _WarmupScheduler(TimeScheduler):
    """Linear warmup from 0 to 1 over ``t_warmup``, then ``decay(fraction_of_the_rest)``."""

    def __init__(self, t_warmup: Time | str, t_max: Time | str = "1dur") -> None:
        self.t_warmup = Time.parse(t_warmup)
        self.t_max = Time.parse(t_max)

    def decay(self, fraction: float) -> float:
        raise NotImplementedError

    def multiplier(self, state: State) -> float:
        progress = state.progress
        warmup = duration_fraction(self.t_warmup, state)
        if progress < warmup:
            return progress / warmup
        end = duration_fraction(self.t_max, state)
        fraction = 1.0 if end <= warmup else min((progress - warmup) / (end - warmup), 1.0)
        return self.decay(fraction)


@registry.schedulers.register("constant_with_warmup")
class ConstantWithWarmupScheduler(_WarmupScheduler):
    def __init__(self, t_warmup: Time | str, alpha: float = 1.0, t_max: Time | str = "1dur") -> None:
        super().__init__(t_warmup, t_max)
        self.alpha = alpha

    def decay(self, fraction: float) -> float:
        return self.alpha


@registry.schedulers.register("cosine_with_warmup")
class CosineWithWarmupScheduler(_WarmupScheduler):
    """Warmup, then half a cosine from 1 down to ``alpha_f`` at ``t_max``."""

    def __init__(self, t_warmup: Time | str, alpha_f: float = 0.0, t_max: Time | str = "1dur") -> None:
        super().__init__(t_warmup, t_max)
        self.alpha_f = alpha_f

    def decay(self, fraction: float) -> float:
        return self.alpha_f + (1 - self.alpha_f) * 0.5 * (1 + math.cos(math.pi * fraction))


@registry.schedulers.register("linear_decay_with_warmup")
class LinearWithWarmupScheduler(_WarmupScheduler):
    """Warmup, then a straight line from ``alpha_i`` down to ``alpha_f`` at ``t_max``."""

    def __init__(
        self, t_warmup: Time | str, alpha_i: float = 1.0, alpha_f: float = 0.0, t_max: Time | str = "1dur"
    ) -> None:
        super().__init__(t_warmup, t_max)
        self.alpha_i = alpha_i
        self.alpha_f = alpha_f

    def decay(self, fraction: float) -> float:
        return self.alpha_i + (self.alpha_f - self.alpha_i) * fraction
