"""The range of every numeric setting, in one table: the YAML config and the Python API check values against it.

A value outside its range is refused before anything is built, with a ``ConfigError`` naming the key,
the value and what it may be. ``TrainConfig`` checks its keys and its loaders' keys when parsed; the
``Trainer`` and the dataloader builders check the same keys when called from Python. (Durations are
``Time`` values, checked by ``foundry.core.time.positive_time``; optimizer hyperparameters by
``foundry.optim.optimizers.check_hyperparameters``.)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from foundry.errors import ConfigError


@dataclass(frozen=True)
class Bound:
    """Values ``>= minimum`` (``> minimum`` when not ``inclusive``) and ``< below``, plus the ``special`` values,
    each with its meaning."""

    minimum: float
    unit: str
    inclusive: bool = True
    below: float = math.inf
    integer: bool = True
    special: tuple[tuple[Any, str], ...] = ()

    def admits(self, value: Any) -> bool:
        if any(value == special and type(value) is type(special) for special, _ in self.special):
            return True
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.integer and not (isinstance(value, int) or (math.isfinite(value) and value == int(value))):
            return False
        if not math.isfinite(value):
            return False
        return (value >= self.minimum if self.inclusive else value > self.minimum) and value < self.below

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a number"
        minimum = int(self.minimum) if self.integer else self.minimum
        upper = f" and < {self.below:.0f}" if math.isfinite(self.below) else ""
        text = f"{kind} {'>=' if self.inclusive else '>'} {minimum}{upper} ({self.unit})"
        for special, meaning in self.special:
            text += f", or {special!r} ({meaning})" if special is not None else f", or null ({meaning})"
        return text


BOUNDS: dict[str, Bound] = {
    # the run
    "seed": Bound(0, "torch takes seeds below 2**64", below=2**64),
    "global_train_batch_size": Bound(1, "samples per optimizer step"),
    "device_train_microbatch_size": Bound(
        1, "samples per forward/backward", special=(("auto", "the largest that fits"), (None, "the whole batch"))
    ),
    "device_eval_batch_size": Bound(1, "eval samples per device", special=((None, "the train batch size"),)),
    "eval_subset_num_batches": Bound(1, "batches per evaluation", special=((-1, "the whole eval set"),)),
    "max_seq_len": Bound(1, "tokens", special=((None, "unset"),)),
    "icl_seq_len": Bound(1, "tokens per ICL row", special=((None, "max_seq_len"),)),
    "dist_timeout": Bound(0, "seconds", inclusive=False, integer=False),
    # checkpoints
    "save_num_checkpoints_to_keep": Bound(0, "checkpoints kept", special=((-1, "all"),)),
    "save_upload_retries": Bound(0, "retries of a failed upload"),
    "save_upload_backoff_s": Bound(0, "seconds before the first retry", integer=False),
    "save_max_failed_uploads": Bound(1, "checkpoints in a row whose upload failed"),
    # loaders
    "num_workers": Bound(0, "worker processes; 0 loads in the training process"),
    "prefetch_factor": Bound(1, "batches each worker loads ahead", special=((None, "torch's default"),)),
    "timeout": Bound(0, "seconds; 0 waits forever", integer=False),
}


def check_bounds(values: Mapping[str, Any], key_path: str = "") -> None:
    """Raise ``ConfigError`` for the first of ``values`` (key -> value) outside its ``BOUNDS`` range.

    Keys without a bound are not checked. ``key_path`` prefixes the key in the message (``train_loader``).
    """
    for key, value in values.items():
        bound = BOUNDS.get(key)
        if bound is None or bound.admits(value):
            continue
        name = f"{key_path}.{key}" if key_path else key
        raise ConfigError(f"'{name}' is {value!r}; it must be {bound.describe()}.")
