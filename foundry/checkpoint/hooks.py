"""What a model may change about how checkpoints save and load it, without checkpoint code knowing why.

A model that saves only part of its weights (and loads the rest from another checkpoint first), or whose
stored weights are not what a checkpoint holds (4-bit codes of bf16 values, built and loaded a block at a
time), exposes ``checkpoint_hooks``; every other model gets these defaults: save everything, load everything,
in one piece.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any


class CheckpointHooks:
    """The defaults: a checkpoint holds every model tensor, and loading needs every one of them."""

    def state_to_save(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """The model tensors a checkpoint stores (of ``model_state``, the model's whole state)."""
        return model_state

    def saves_frozen_weights(self) -> bool:
        """Whether a checkpoint holds the weights no optimizer trains; when not, they stay out of the state dict."""
        return True

    def loads_frozen_weights(self, saved: Collection[str]) -> bool:
        """Whether a checkpoint holding the model keys ``saved`` sets frozen weights; when not, the state dict it
        loads into holds the trainable ones alone."""
        return True

    def weights_as_stored(self) -> AbstractContextManager:
        """Within: the model's state dict may hold weights as the model stores them (4-bit codes, say), for a
        caller that drops them (``saves_frozen_weights``) or loads through ``parts_to_load``."""
        return contextlib.nullcontext()

    def parts_to_load(self, tensors: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """``tensors`` (``model``, maybe ``optim``; built under ``weights_as_stored``) in the parts that load one
        after another, each as DCP reads into it and ``set_state_dict`` copies it into the model."""
        yield tensors

    def save_refusal(self, model: Any) -> str | None:
        """Why this rank cannot build ``model``'s checkpoint where it is (a paragraph naming the fix), or None."""
        return None

    def loadable_without(self, missing: Collection[str], saved: Collection[str]) -> bool:
        """Whether a checkpoint holding the model keys ``saved`` loads although it lacks ``missing``."""
        return not missing

    def before_load(self, folder: Path, state: Any, load: Callable[[Path], None]) -> None:
        """Run before checkpoint ``folder`` loads into ``state``; ``load(path)`` loads another one's weights."""


def checkpoint_hooks(model: Any) -> CheckpointHooks:
    """``model.checkpoint_hooks`` where the model has them, else the defaults."""
    hooks = getattr(model, "checkpoint_hooks", None)
    return hooks if isinstance(hooks, CheckpointHooks) else CheckpointHooks()
