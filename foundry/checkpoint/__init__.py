"""Checkpoints that are atomic on disk, safe to load, and resume a run exactly."""

from foundry.checkpoint.checkpointer import (
    PendingCheckpoint,
    latest_checkpoint,
    load_checkpoint,
    resolve_checkpoint_path,
    save_checkpoint,
    start_checkpoint,
)
from foundry.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner

__all__ = [
    "PendingCheckpoint",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "latest_checkpoint",
    "load_checkpoint",
    "resolve_checkpoint_path",
    "save_checkpoint",
    "start_checkpoint",
]
