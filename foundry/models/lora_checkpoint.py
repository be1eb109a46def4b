"""LoRA checkpoints: what an adapters-only save keeps, and which checkpoint holds the base under an adapter.

A checkpoint of a LoRA run holds every weight, unless ``model.peft_config.save_adapters_only`` is
set: then its model part is the adapter tensors alone (its optimizer state is adapters-only anyway).
Such a checkpoint names its base through its run's ``load_path``, which ``LoraCheckpointHooks``
loads first: LoRA models hand these hooks to ``foundry.checkpoint`` (``model.checkpoint_hooks``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp

from foundry.checkpoint.find import resolve_checkpoint_path
from foundry.checkpoint.hf_weights import layer_of
from foundry.checkpoint.hooks import CheckpointHooks
from foundry.checkpoint.meta import read_meta
from foundry.checkpoint.safe_reader import SafeFileSystemReader, SafeLoadPlanner
from foundry.errors import CheckpointError
from foundry.models.lora import LoraConfig, is_adapter_key, nf4_weights_kept_as_codes
from foundry.models.nf4 import dequantize, dequantized_bytes, is_nf4

if TYPE_CHECKING:
    from torch import nn


_MAX_BASE_DEPTH = 8  # adapters trained from adapters: a chain this long is surely a loop


class LoraCheckpointHooks(CheckpointHooks):
    """A LoRA model's checkpoints: maybe the adapters alone, whose base weights load first."""

    def __init__(self, config: LoraConfig) -> None:
        self.config = config

    def state_to_save(self, model_state: dict[str, Any]) -> dict[str, Any]:
        if not self.config.save_adapters_only:
            return model_state
        return {name: tensor for name, tensor in model_state.items() if is_adapter_key(name)}

    def saves_frozen_weights(self) -> bool:
        return not self.config.save_adapters_only

    def loads_frozen_weights(self, saved: Collection[str]) -> bool:
        """An adapters-only checkpoint sets the adapters alone (its base was loaded before)."""
        return not adapters_alone(saved)

    def weights_as_stored(self) -> AbstractContextManager:
        return nf4_weights_kept_as_codes()

    def parts_to_load(self, tensors: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """A model with NF4 weights loads a block at a time: each block's NF4 weights are dequantized to bf16 for
        DCP to read into, then quantized as they are copied into the model. A rank holds a block or two in bf16,
        not its whole share (200 GB a rank for Llama-405B on 4 GPUs)."""
        model_state = tensors["model"]
        if not any(map(is_nf4, model_state.values())):
            yield tensors
            return
        others = {name: value for name, value in tensors.items() if name != "model"}  # with the first part
        for keys in keys_by_block(model_state):
            yield {**others, "model": {key: dequantize(model_state[key]) for key in keys}}
            others = {}

    def save_refusal(self, model: nn.Module) -> str | None:
        """A full checkpoint holds the NF4 base as bf16 values, built at once on the device: refused when this
        rank's share would not fit (the alternative is an out-of-memory error in the middle of a save)."""
        if self.config.save_adapters_only:
            return None
        nf4_weights = [weight for weight in model.parameters() if is_nf4(weight)]
        free_bytes = device_free_bytes(nf4_weights[0].device) if nf4_weights else None
        needed_bytes = sum(map(dequantized_bytes, nf4_weights))
        if free_bytes is None or needed_bytes <= free_bytes:
            return None
        return (
            f"Cannot save a full checkpoint of this QLoRA model: it holds the 4-bit NF4 base as bf16 values, which "
            f"this rank builds on its GPU at once ({needed_bytes / 2**30:.2f} GiB), and the GPU has "
            f"{free_bytes / 2**30:.2f} GiB free. Set model.peft_config.save_adapters_only: true (checkpoints of the "
            "adapters alone, which never dequantize the base; it loads from load_path), or train on more GPUs."
        )

    def loadable_without(self, missing: Collection[str], saved: Collection[str]) -> bool:
        """Two cases load although keys are missing: a base checkpoint into a LoRA model (it holds no adapter:
        they keep their init), and an adapters-only checkpoint (only base weights missing: its base was loaded
        first). A checkpoint holding some of the model's adapters but not all (other target_modules) is refused:
        the rest would silently keep their init."""
        if not missing:
            return True
        if not any(map(is_adapter_key, saved)):
            return all(map(is_adapter_key, missing))
        return adapters_alone(saved) and not any(map(is_adapter_key, missing))

    def before_load(self, folder: Path, state: Any, load: Callable[[Path], None], depth: int = 0) -> None:
        """If ``folder`` holds adapters only, load its base weights into ``state.model`` first."""
        if not holds_adapters_only(folder):
            return
        if depth >= _MAX_BASE_DEPTH:
            raise CheckpointError(
                f"Checkpoint {folder}: its chain of adapters-only bases is longer than {depth}; a loop?"
            )
        base = base_checkpoint(folder)
        if base is None:  # an hf_causal_lm base: its pretrained weights, read when the model was built (or now)
            if not state.model.holds_pretrained_weights:
                state.model.load_pretrained_weights()
            return
        self.before_load(base, state, load, depth + 1)
        load(base)


def device_free_bytes(device: torch.device) -> int | None:
    """Free memory on a GPU (None on a CPU, where nothing is checked)."""
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


def lora_checkpoint_hooks(model: nn.Module) -> CheckpointHooks:
    """``LoraCheckpointHooks`` for a model built with a ``peft_config``, else the defaults."""
    config = model_lora_config(model)
    return LoraCheckpointHooks(config) if config is not None else CheckpointHooks()


def model_lora_config(model: nn.Module) -> LoraConfig | None:
    """The ``peft_config`` a model was built with (None: no LoRA)."""
    config = getattr(getattr(model, "config", None), "peft_config", None)
    return config if isinstance(config, LoraConfig) else None


def keys_by_block(model_state: Mapping[str, Any]) -> list[list[str]]:
    """The keys of ``model_state`` grouped by their block (the first index in a name), in order; those outside
    the blocks (embeddings, final norm, output head) form one group."""
    groups: dict[str | None, list[str]] = {}
    for key in model_state:
        groups.setdefault(layer_of(key), []).append(key)
    return list(groups.values())


def saved_model_keys(folder: Path) -> set[str]:
    """The model keys a checkpoint holds (read from its DCP metadata, no tensor is read)."""
    keys = SafeFileSystemReader(folder).read_metadata().state_dict_metadata
    return {key.removeprefix("model.") for key in keys if key.startswith("model.")}


def holds_adapters_only(folder: Path) -> bool:
    return adapters_alone(saved_model_keys(folder))


def adapters_alone(model_keys: Collection[str]) -> bool:
    """Whether a checkpoint holding ``model_keys`` is an adapters-only one (``save_adapters_only``)."""
    return bool(model_keys) and all(map(is_adapter_key, model_keys))


def has_pretrained_base(model_section: Mapping[str, Any]) -> bool:
    """Whether a model section loads its base weights itself: ``hf_causal_lm`` with ``pretrained`` (the default)."""
    return model_section.get("name") == "hf_causal_lm" and model_section.get("pretrained", True) is not False


def base_checkpoint(folder: Path) -> Path | None:
    """The checkpoint that holds the base weights of adapters-only checkpoint ``folder`` (its run's load_path).

    None: the run had no load_path and its model is a pretrained ``hf_causal_lm``, whose base is its
    ``pretrained_model_name_or_path``.
    """
    config = read_meta(folder).get("config") or {}
    load_path = config.get("load_path")
    if not load_path and has_pretrained_base(config.get("model") or {}):
        return None
    if not load_path:
        raise CheckpointError(
            f"Checkpoint {folder} holds LoRA adapters only (model.peft_config.save_adapters_only) and its run had no "
            "load_path, so the base weights it was trained on are unknown. Name the base yourself: "
            f"`foundry eval --model BASE --adapters {folder}`, or load a checkpoint saved with "
            "save_adapters_only: false."
        )
    try:
        return resolve_checkpoint_path(load_path)
    except CheckpointError as error:
        raise CheckpointError(
            f"Checkpoint {folder} holds LoRA adapters only; its base is its run's load_path '{load_path}', which "
            f"cannot be read ({error}). Restore the base there, or name it yourself: "
            f"`foundry eval --model BASE --adapters {folder}`."
        ) from None


def read_adapter_tensors(folder: Path, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter tensors of checkpoint ``folder``, shaped as ``like`` (a model's ``adapter_state_dict``)."""
    saved = saved_model_keys(folder)
    missing = sorted(set(like) - saved)
    if missing:
        raise CheckpointError(
            f"Checkpoint {folder} lacks the adapter tensors {missing[:3]}{'...' if len(missing) > 3 else ''}: it was "
            "not trained with the same model.peft_config (r, target_modules) as this model."
        )
    wanted = {"model": {name: torch.empty_like(tensor, device="cpu") for name, tensor in like.items()}}
    dcp.load(wanted, storage_reader=SafeFileSystemReader(folder), planner=SafeLoadPlanner(allow_partial_load=True))
    return wanted["model"]
