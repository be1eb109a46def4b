"""A relaunch that resumes from its own save_folder trains what its checkpoint was trained with, unless told otherwise.

A checkpoint's ``meta.json`` holds the resolved YAML of the ``foundry train`` run that saved it. When a
run resumes from a checkpoint of its own save_folder (``autoresume``), the keys that decide what is
trained must be the same: the global batch, the sequence length, the seed, the train data, the
optimizer and the schedule (``TRAINED_KEYS``). A difference is refused, naming each key and both values,
unless ``autoresume_accept_changes: true`` says it is on purpose (a new stage with a larger batch): then
each change is logged. Keys that only change how the run goes (logging, evaluation, microbatch size,
precision, ``max_duration``, data-loader workers) pass silently. A checkpoint of a Python-API run that
passed no ``config`` has nothing to compare, and passes too.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from foundry.checkpoint.meta import dotted_leaves, read_meta
from foundry.errors import ConfigError

log = logging.getLogger(__name__)

TRAINED_KEYS = ("global_train_batch_size", "max_seq_len", "seed", "train_loader", "optimizer", "scheduler")
# Keys of a loader that change how fast batches arrive, not which.
LOADER_PLUMBING = frozenset({"num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "timeout"})
ACCEPT_KEY = "autoresume_accept_changes"


def check_resumed_config(checkpoint: Path, config: Mapping[str, Any] | None, accept_changes: bool) -> None:
    """Raise ``ConfigError`` if ``config`` differs from ``checkpoint``'s recorded config in what is trained
    (log the differences instead with ``accept_changes``)."""
    recorded = read_meta(checkpoint).get("config")
    if config is None or not isinstance(recorded, Mapping):
        return
    changes = changed_trained_keys(recorded, config)
    if not changes:
        return
    listed = "; ".join(f"{key}: {before!r} in the checkpoint, {after!r} now" for key, before, after in changes)
    if accept_changes:
        log.warning("Resuming from %s with changed settings (%s: true): %s.", checkpoint, ACCEPT_KEY, listed)
        return
    raise ConfigError(
        f"This run resumes from {checkpoint}, but trains with other settings than that checkpoint: {listed}. A "
        f"relaunch that continues a run must train the same way. Restore those values, or set {ACCEPT_KEY}: true "
        "to continue with the new ones on purpose (e.g. a new stage with a larger batch), or start afresh in a new "
        "save_folder."
    )


def changed_trained_keys(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(key path, recorded value, current value)`` for each leaf of ``TRAINED_KEYS`` that differs."""
    # a key set to None and a key left out compare equal (both .get() to None)
    before = dotted_leaves({key: recorded.get(key) for key in TRAINED_KEYS})
    after = dotted_leaves({key: current.get(key) for key in TRAINED_KEYS})
    return [
        (key, before.get(key), after.get(key))
        for key in sorted(before.keys() | after.keys())
        if before.get(key) != after.get(key) and key.rsplit(".", 1)[-1] not in LOADER_PLUMBING
    ]
