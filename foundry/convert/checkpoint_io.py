"""A model out of a foundry checkpoint, and a weights-only checkpoint out of a model."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundry.checkpoint import load_checkpoint, resolve_checkpoint_path, save_checkpoint
from foundry.checkpoint.hooks import checkpoint_hooks
from foundry.checkpoint.meta import model_section, read_meta, tokenizer_section
from foundry.core.paths import is_object_store_url
from foundry.core.state import State
from foundry.core.time import Time
from foundry.errors import CheckpointError, ConfigError
from foundry.models.build import build_model
from foundry.models.hf import refill_computed_buffers
from foundry.models.nf4 import dequantize, is_nf4


def checkpoint_config(folder: Path) -> dict[str, Any]:
    """What rebuilds a checkpoint's model: its run's config, with ``model`` (and ``tokenizer`` when known)
    taken from the model's own record in ``meta.json`` (``foundry.checkpoint.meta``)."""
    meta = read_meta(folder)
    model = model_section(meta)
    if model is None:
        raise CheckpointError(
            f"Checkpoint {folder} does not say which model it holds: its model is not a registered foundry model "
            "(foundry.registry.models) with a config dataclass, and its run passed no config. Register the model "
            "class (@foundry.registry.models.register('name')) so its checkpoints record it."
        )
    config = dict(meta.get("config") or {})
    config["model"] = model
    tokenizer = tokenizer_section(meta)
    if tokenizer is not None:
        config["tokenizer"] = tokenizer
    return config


def meta_model(model_section: Mapping[str, Any]) -> nn.Module:
    """The model of ``model_section`` with every weight on the meta device: no memory, no random init."""
    return build_model({**model_section, "init_device": "meta"})


def load_checkpoint_model(folder: Path, model_section: Mapping[str, Any], *, with_base: bool = True) -> nn.Module:
    """``model_section``'s model on CPU holding the weights of checkpoint ``folder`` (nothing else is read).

    An adapters-only LoRA checkpoint holds no base weights: its base is loaded first, from where its
    run loaded it (the model's ``checkpoint_hooks``). ``with_base=False`` reads the
    adapters alone (exporting them needs nothing else); every other weight is then NaN. Otherwise a
    weight that no checkpoint filled is an error (``check_weights_loaded``), never a model with
    uninitialised memory for weights.
    """
    model = unloaded_model(model_section)
    state = State(model=model, max_duration=Time.parse("1ba"))
    if with_base:
        checkpoint_hooks(model).before_load(folder, state, lambda base: load_checkpoint(base, state, weights_only=True))
    load_checkpoint(folder, state, weights_only=True)
    if with_base:
        check_weights_loaded(model, f"Checkpoint {folder}")
    return model


def assign_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> nn.Module:
    """Put ``state``'s tensors into meta-device ``model`` as they are (no copy); every weight must be set."""
    result = model.load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):  # transformers: the output head shares the embedding when tied
        model.tie_weights()
    refill_computed_buffers(model, "cpu")
    tensors = [*model.named_parameters(), *model.named_buffers()]
    left_on_meta = [name for name, tensor in tensors if tensor.is_meta]
    if result.unexpected_keys or left_on_meta:
        raise ConfigError(
            f"Converting {source} left weights unset {left_on_meta[:5]} or unused {result.unexpected_keys[:5]}: "
            "the weight files lack them (an incomplete download or copy?), or this is a bug in its foundry/convert "
            "adapter."
        )
    return model


def stream_into(
    model: nn.Module,
    layers: Iterator[dict[str, torch.Tensor]],
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    source: str,
) -> nn.Module:
    """Put each of ``layers``, renamed by ``convert``, into meta-device ``model`` as fp32 (no further copy).

    Host memory holds the model being filled plus one layer; a name the model lacks is an adapter's bug.
    """
    unused: list[str] = []
    for layer in layers:
        state = {name: _fp32(tensor) for name, tensor in convert(layer).items()}
        unused += model.load_state_dict(state, strict=False, assign=True).unexpected_keys
    if unused:
        raise ConfigError(
            f"Converting {source} produced weights the model does not have {unused[:5]}; this is a bug in its "
            "foundry/convert adapter."
        )
    return model


def _fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor


def unloaded_model(model_section: Mapping[str, Any]) -> nn.Module:
    """``model_section``'s model on CPU, every weight NaN until something loads it (``check_weights_loaded``)."""
    model = meta_model(model_section).to_empty(device="cpu")
    with torch.no_grad(), checkpoint_hooks(model).weights_as_stored():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point() and not is_nf4(tensor):  # 4-bit weights: NaN since to_empty
                tensor.fill_(float("nan"))
    return model


def check_weights_loaded(model: nn.Module, source: str, ignore: Callable[[str], bool] = lambda name: False) -> None:
    """Raise if a weight of ``model`` (built by ``unloaded_model``) is still all NaN: nothing loaded it.

    ``ignore(name)``: weights that something else fills later (e.g. adapters switched in).
    """
    with checkpoint_hooks(model).weights_as_stored():  # 4-bit weights dequantized one at a time below, not at once
        state = model.state_dict()
    unloaded = [name for name, tensor in state.items() if not ignore(name) and _all_nan(dequantize(tensor))]
    if unloaded:
        raise CheckpointError(
            f"{source} left {len(unloaded)} weights of the model unloaded ({', '.join(unloaded[:3])}"
            f"{', ...' if len(unloaded) > 3 else ''}), so it would compute with no weights. For a LoRA checkpoint "
            "saved with save_adapters_only, its base must load too: evaluate it as "
            "`foundry eval --model BASE --adapters CHECKPOINT`."
        )


def _all_nan(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and bool(tensor.numel()) and bool(torch.isnan(tensor).all())


def resolve_checkpoint(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """(checkpoint folder, its run's config); ``path`` is a checkpoint folder or a save_folder (its latest)."""
    folder = resolve_checkpoint_path(path)
    return folder, checkpoint_config(folder)


def save_weights_checkpoint(model: nn.Module, save_folder: Path, config: dict[str, Any], overwrite: bool) -> Path:
    """A checkpoint at batch 0 holding only ``model``'s weights; ``load_path`` + ``load_weights_only`` read it."""
    state = State(model=model, max_duration=Time.parse("1ba"))
    return save_checkpoint(save_folder, state, config=config, overwrite=overwrite)


def check_out_dir(out_dir: Path, overwrite: bool) -> Path:
    if out_dir.is_file() or (out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite):
        raise ConfigError(f"{out_dir} exists and is not empty; pass --overwrite to replace it, or choose another.")
    return out_dir


def write_atomically(out_dir: Path, write: Callable[[Path], None]) -> None:
    """Run ``write(tmp_dir)`` beside ``out_dir``, then move the result into place: no half-written export."""
    tmp_dir = out_dir.parent / f".tmp-{out_dir.name}-{secrets.token_hex(4)}"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        write(tmp_dir)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp_dir.rename(out_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


# What the commands that read models from disk read (`foundry eval --model`, `foundry.load_model`).
MODELS_ON_DISK = (
    "Models are read from disk, never downloaded: a foundry checkpoint, a save_folder, or a Hugging Face model "
    "directory."
)


def check_model_path(path: str | Path) -> None:
    """A ``ConfigError`` saying what ``path`` is and what to pass instead, unless something is there (or it is
    an object-store URL, fetched when loaded)."""
    given = str(path)
    if not is_object_store_url(given) and not Path(given).expanduser().exists():
        raise ConfigError(nothing_at(given))


def nothing_at(given: str, reads: str = MODELS_ON_DISK, then: str = "pass {folder}") -> str:
    """Why a model path that does not exist cannot load, and what to pass instead: ``reads`` says what the command
    reads; ``then`` what to do with the folder a Hub id is downloaded to (``{folder}``)."""
    what = f"No model at '{given}': there is no such file or folder (looked in {Path(given).resolve().parent})."
    if given.startswith(("/", ".", "~")) or given.count("/") > 1:
        return f"{what} {reads} Check the path."
    folder = f"models/{given}"
    return (
        f"{what} '{given}' reads as a Hugging Face Hub id, not a local folder. {reads} On a machine with internet, "
        f"save it once with `hf download {given} --local-dir {folder}` (`huggingface-cli download` on older "
        f"huggingface_hub; or transformers' save_pretrained) and {then.format(folder=folder)}."
    )
