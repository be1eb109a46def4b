"""Optimizers and LR schedules, registered by their YAML names."""

from foundry.optim.build import build_optimizers, build_schedulers
from foundry.optim.optimizers import DecoupledAdamW, DecoupledLionW
from foundry.optim.schedulers import (
    ConstantScheduler,
    ConstantWithWarmupScheduler,
    CosineWithWarmupScheduler,
    LinearWithWarmupScheduler,
    TimeScheduler,
    absolute_time,
)

__all__ = [
    "ConstantScheduler",
    "ConstantWithWarmupScheduler",
    "CosineWithWarmupScheduler",
    "DecoupledAdamW",
    "DecoupledLionW",
    "LinearWithWarmupScheduler",
    "TimeScheduler",
    "build_optimizers",
    "build_schedulers",
    "absolute_time",
]
