"""Built-in callbacks; importing this package registers them under their YAML names."""

from foundry.callbacks.lr_monitor import LRMonitor
from foundry.callbacks.memory_monitor import MemoryMonitor
from foundry.callbacks.runtime_estimator import RuntimeEstimator
from foundry.callbacks.speed_monitor import SpeedMonitor, TrainClock

__all__ = ["LRMonitor", "MemoryMonitor", "RuntimeEstimator", "SpeedMonitor", "TrainClock"]
