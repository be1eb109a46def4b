"""What the Trainer steps: its optimizers (given, built from the trainable parameters, or the default) and
the LR schedules bound to them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from foundry.core import State
from foundry.errors import ConfigError
from foundry.optim.optimizers import DecoupledAdamW
from foundry.optim.schedulers import TimeScheduler


def build_optimizers(optimizers: Any, model: nn.Module) -> list[torch.optim.Optimizer]:
    """The optimizers to step: given, built by a factory from the trainable parameters, or the default."""
    if optimizers is None:
        return [DecoupledAdamW(model.parameters(), lr=3e-4)]
    if callable(optimizers) and not isinstance(optimizers, torch.optim.Optimizer):
        return [
            optimizers([parameter for parameter in model.parameters() if parameter.requires_grad])
        ]  # frozen weights (LoRA's base) get no optimizer state
    return _as_list(optimizers)


def build_schedulers(schedulers: Any, state: State) -> list[Any]:
    """``schedulers`` (one, several or None) as a list stepped once per batch; ``TimeScheduler``s bound to ``state``."""
    return [_as_torch_scheduler(scheduler, state) for scheduler in _as_list(schedulers)]


def _as_torch_scheduler(scheduler: Any, state: State) -> Any:
    if isinstance(scheduler, TimeScheduler):
        if len(state.optimizers) != 1:
            raise ConfigError("A TimeScheduler needs exactly one optimizer; wrap each optimizer's scheduler yourself.")
        return scheduler.to_torch(state.optimizers[0], state)
    return scheduler


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]
