"""Checkpoints that are atomic on disk, safe to load, and resume a run exactly.

``layout`` (the folder and its files), ``integrity`` (the manifest's checksums), ``find`` (the
checkpoint to load), ``save`` (writing, async, retention), ``load`` (reading, resharding, restoring
the training state), ``hooks`` (what a model may change about its checkpoints), ``consolidate`` (one file out of
a sharded checkpoint), ``object_store``, ``remote`` and ``uploader`` (a save_folder on an object store).
"""

from foundry.checkpoint.find import latest_checkpoint, resolve_checkpoint_path
from foundry.checkpoint.load import load_checkpoint
from foundry.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner
from foundry.checkpoint.save import PendingCheckpoint, save_checkpoint, start_checkpoint

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
