"""Built-in callbacks; importing this package registers them under their YAML names."""

from foundry.callbacks.early_stopping import EarlyStopper, ThresholdStopper
from foundry.callbacks.hand_over import HandOver
from foundry.callbacks.hf_checkpointer import HFCheckpointer
from foundry.callbacks.lr_monitor import LRMonitor
from foundry.callbacks.memory_monitor import MemoryMonitor
from foundry.callbacks.memory_snapshot import MemorySnapshot
from foundry.callbacks.moe_monitor import MoEMonitor
from foundry.callbacks.optimizer_monitor import OptimizerMonitor
from foundry.callbacks.plot_curves import PlotCurves
from foundry.callbacks.profiler import Profiler
from foundry.callbacks.reference_curve import ReferenceCurve
from foundry.callbacks.runtime_estimator import RuntimeEstimator
from foundry.callbacks.speed_monitor import SpeedMonitor, TrainClock

__all__ = [
    "EarlyStopper",
    "HFCheckpointer",
    "HandOver",
    "LRMonitor",
    "MemoryMonitor",
    "MemorySnapshot",
    "MoEMonitor",
    "OptimizerMonitor",
    "PlotCurves",
    "Profiler",
    "ReferenceCurve",
    "RuntimeEstimator",
    "SpeedMonitor",
    "ThresholdStopper",
    "TrainClock",
]
