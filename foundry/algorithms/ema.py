"""Exponential moving average of the weights, used for eval and (optionally) as the final model.

After every ``update_interval`` batches: ``ema = smoothing * ema + (1 - smoothing) * weights``,
with ``smoothing`` given or derived from a ``half_life`` (the weights' influence halves every
``half_life`` batches). Under FSDP2 each rank averages its own shards (the EMA tensors are
DTensors like the parameters), so memory is one more sharded copy of the model.

Eval swaps the EMA weights in at EVAL_START and back at EVAL_END. Checkpoints: the EMA tensors go
to ``<checkpoint>/ema/`` (DCP, so they reshard across world sizes like the model) once the
checkpoint is written, and a resumed run reads them back from there.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from foundry import registry
from foundry.core.algorithm import Algorithm
from foundry.core.event import Event
from foundry.core.logger import Logger
from foundry.core.state import State
from foundry.core.time import Time, TimeUnit
from foundry.errors import CheckpointError, ConfigError

EMA_FOLDER = "ema"
_KEY = "algorithms.ema"


@registry.algorithms.register("ema")
class EMA(Algorithm):
    """Keep an exponential moving average of the model's parameters.

    Args:
        half_life: batches (``"1000ba"``, the default) after which a weight's contribution halves.
        smoothing: the per-update decay instead of ``half_life`` (e.g. 0.999); give one of the two.
        update_interval: how often to update (``"1ba"``: every batch).
        eval_with_ema: evaluate with the EMA weights.
        swap_at_fit_end: leave the EMA weights in the model when ``fit()`` ends.
    """

    def __init__(
        self,
        half_life: str | Time | None = None,
        smoothing: float | None = None,
        update_interval: str | Time = "1ba",
        eval_with_ema: bool = True,
        swap_at_fit_end: bool = False,
    ) -> None:
        self.update_interval = _batches(update_interval, "update_interval")
        if smoothing is not None and half_life is not None:
            raise ConfigError(f"'{_KEY}' sets both half_life and smoothing; keep one.")
        if smoothing is not None and not 0.0 <= smoothing < 1.0:
            raise ConfigError(f"'{_KEY}.smoothing' is {smoothing}; it must be in [0, 1).")
        if smoothing is None:
            smoothing = 0.5 ** (self.update_interval / _batches(half_life or "1000ba", "half_life"))
        self.smoothing = float(smoothing)
        self.eval_with_ema = eval_with_ema
        self.swap_at_fit_end = swap_at_fit_end
        self.weights: dict[str, torch.Tensor] = {}
        self.num_updates = 0
        self._load_weights_from_checkpoint = False
        self._swapped_in = False

    def match(self, event: Event, state: State) -> bool:
        return event in _EVENTS

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event in (Event.AFTER_LOAD, Event.FIT_START) and not self.weights:
            self.weights = {name: p.detach().clone() for name, p in state.model.named_parameters()}
            if self._load_weights_from_checkpoint and state.last_checkpoint_path:
                self._load(Path(state.last_checkpoint_path))
        elif event == Event.BATCH_END and state.timestamp.batch % self.update_interval == 0:
            self.update(state.model)
        elif event in (Event.EVAL_START, Event.EVAL_END) and self._swaps_at(event):
            self.swap(state.model)
        elif event in (Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT) and state.last_checkpoint_path:
            with _quiet_single_process():
                dcp.save(self.weights, storage_writer=dcp.FileSystemWriter(_folder(state.last_checkpoint_path)))
        elif event == Event.FIT_END and self.swap_at_fit_end and self.weights:
            self.swap(state.model)
            self.weights = {}  # the model now holds the average; nothing left to swap back

    def _swaps_at(self, event: Event) -> bool:
        """EMA weights go in at EVAL_START (if eval uses them) and out at EVAL_END."""
        if event == Event.EVAL_START:
            return self.eval_with_ema and bool(self.weights) and not self._swapped_in
        return self._swapped_in

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """Move the average towards the current weights (one fused kernel for all tensors)."""
        params = [_local(p) for _, p in model.named_parameters()]
        torch._foreach_lerp_([_local(w) for w in self.weights.values()], params, 1.0 - self.smoothing)
        self.num_updates += 1

    @torch.no_grad()
    def swap(self, model: torch.nn.Module) -> None:
        """Exchange the model's weights and the EMA weights in place."""
        for name, param in model.named_parameters():
            current, average = _local(param), _local(self.weights[name])
            backup = current.clone()
            current.copy_(average)
            average.copy_(backup)
        self._swapped_in = not self._swapped_in

    def state_dict(self) -> dict[str, Any]:
        return {"num_updates": self.num_updates, "smoothing": self.smoothing}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_updates = state["num_updates"]
        self._load_weights_from_checkpoint = True

    def _load(self, checkpoint: Path) -> None:
        folder = _folder(checkpoint)
        if not folder.is_dir():
            raise CheckpointError(
                f"Checkpoint {checkpoint} was saved with algorithms.ema but has no {EMA_FOLDER}/ folder (the run "
                "stopped between writing the checkpoint and its EMA weights). Load an earlier checkpoint."
            )
        with _quiet_single_process():
            dcp.load(self.weights, storage_reader=dcp.FileSystemReader(folder))


_EVENTS = {
    Event.AFTER_LOAD,
    Event.FIT_START,
    Event.BATCH_END,
    Event.EVAL_START,
    Event.EVAL_END,
    Event.BATCH_CHECKPOINT,
    Event.EPOCH_CHECKPOINT,
    Event.FIT_END,
}


def _batches(value: str | Time, key: str) -> int:
    time = Time.parse(value)
    if time.unit != TimeUnit.BATCH or time.value <= 0:
        raise ConfigError(f"'{_KEY}.{key}' is '{value}'; give a positive number of batches, e.g. '100ba'.")
    return time.value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of its storage), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _folder(checkpoint: str | Path) -> Path:
    return Path(checkpoint) / EMA_FOLDER


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # Without a process group DCP warns that it assumes one process: that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to .* in a single process")
        yield
