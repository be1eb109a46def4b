"""Checkpoints that are atomic on disk, safe to load, and resume a run exactly.

``config`` (the run's checkpoint section) and ``saver`` (its ``Checkpointer``: the section's checks, resume
and cadence), ``owner`` (whose checkpoints a save_folder holds), ``layout`` (the folder and its files),
``meta`` (meta.json), ``integrity`` (the manifest's checksums), ``find`` (the checkpoint to load), ``save``
(writing, async, retention), ``load`` (reading, resharding, restoring the training state), ``hooks`` (what
a model may change about its checkpoints), ``consolidate`` (one file out of a sharded checkpoint),
``object_store``, ``remote`` and ``uploader`` (a save_folder on an object store).
"""

from __future__ import annotations

from foundry.lazy import lazy_exports

_EXPORTS = {
    "CheckpointConfig": "foundry.checkpoint.config",
    "Checkpointer": "foundry.checkpoint.saver",
    "PendingCheckpoint": "foundry.checkpoint.save",
    "SafeFileSystemReader": "foundry.checkpoint.safe_reader",
    "SafeLoadPlanner": "foundry.checkpoint.safe_reader",
    "latest_checkpoint": "foundry.checkpoint.find",
    "load_checkpoint": "foundry.checkpoint.load",
    "resolve_checkpoint_path": "foundry.checkpoint.find",
    "save_checkpoint": "foundry.checkpoint.save",
    "start_checkpoint": "foundry.checkpoint.save",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
