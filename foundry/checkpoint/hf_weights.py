"""A Hugging Face folder's weights read one file at a time, handed on one layer at a time.

A 335 GB checkpoint does not fit beside its model in a 192 GB host (llm-foundry #463), so nothing here holds
more than one file's mapping plus one layer: ``layers_of_folder`` yields each layer's tensors
(``model.layers.7.*``) as soon as its last one is read, and each tensor outside the layers (embeddings, final
norm, output head) on its own. A layer is the unit a conversion needs whole: Llama's fused ``Wqkv`` needs q, k
and v together, an MoE layer all its experts. ``foundry convert from-hf`` fills a model from it
(``foundry.convert.checkpoint_io.stream_into``), and so does a sharded ``hf_causal_lm`` rank, keeping its slices.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import re
import zipfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from foundry.errors import CheckpointError

_LAYER_INDEX = re.compile(r"\.(\d+)\.")  # the first index in a name is its layer: model.layers.3.mlp.experts.7.w1


def layers_of_folder(folder: Path) -> Iterator[dict[str, torch.Tensor]]:
    """Every tensor of ``folder``'s ``*.safetensors`` files (else its ``pytorch_model*.bin`` files, read with
    ``weights_only``: tensors, never code), grouped by layer, reading one file at a time."""
    files = weight_files(folder)
    left_in_layer: Counter[str] = Counter()
    file_of: dict[str, Path] = {}
    for path in files:  # headers only: how many tensors each layer has, wherever they sit
        with _open_weights(path) as tensors:
            names = tensors.keys()  # safetensors' reader is no mapping: it has keys() but no __iter__
            left_in_layer.update(layer for name in names if (layer := layer_of(name)) is not None)
        if twice := [name for name in names if file_of.setdefault(name, path) != path]:
            raise CheckpointError(
                f"{folder} holds {twice[0]!r} in both {file_of[twice[0]].name} and {path.name}, so which one the "
                "model is is ambiguous (files of two saves side by side?). Keep one save's files, or add the "
                "model.safetensors.index.json that names them."
            )
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for path in files:
        with _open_weights(path) as tensors:  # the file's mapping is released when it closes
            names = tensors.keys()
            for name in names:
                layer = layer_of(name)
                if layer is None:
                    yield {name: tensors.get_tensor(name)}
                    continue
                pending.setdefault(layer, {})[name] = tensors.get_tensor(name)
                left_in_layer[layer] -= 1
                if not left_in_layer[layer]:
                    yield pending.pop(layer)


def weight_files(folder: Path) -> list[Path]:
    """``folder``'s safetensors files, else its PyTorch ones; a ``CheckpointError`` when it has neither.

    Where an index names the files (``model.safetensors.index.json``), only those: another save into the same
    folder may have left files of an older layout beside them.
    """
    for index_name, pattern in (
        ("model.safetensors.index.json", "*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    ):
        index = folder / index_name
        if index.is_file():
            return [folder / name for name in sorted(set(_weight_map(index).values()))]
        files = sorted(folder.glob(pattern))
        if files:
            return files
    raise CheckpointError(
        f"{folder} has a config.json but no weights (*.safetensors or pytorch_model*.bin); copy the whole "
        "folder that was exported."
    )


def _weight_map(index: Path) -> dict[str, str]:
    try:
        return dict(json.loads(index.read_text())["weight_map"])
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(
            f"{index} is not a weights index (JSON with a 'weight_map' of tensor name -> file): {error!r}. Download "
            "the model again, or remove the index if the folder holds a single weights file."
        ) from None


@contextlib.contextmanager
def _open_weights(path: Path) -> Iterator[Any]:
    """A reader of one weights file (``keys()``, ``get_tensor(name)``) that maps it rather than reading it whole."""
    from safetensors import SafetensorError, safe_open

    try:
        if path.suffix == ".safetensors":
            with safe_open(path, framework="pt") as reader:
                yield reader
        else:  # transformers' older format: a pickle of tensors, unpickled with weights_only
            mappable = zipfile.is_zipfile(path)  # torch.save's format since 1.6; the older one is read whole
            yield _TensorDict(torch.load(path, weights_only=True, mmap=mappable, map_location="cpu"))
    except (SafetensorError, pickle.UnpicklingError, RuntimeError, OSError, EOFError, ValueError) as error:
        reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else type(error).__name__
        raise CheckpointError(
            f"Cannot read the weights in {path}: {type(error).__name__}: {reason}. The file is damaged, incomplete, "
            "or holds objects other than tensors (a pickle that would run code, which foundry refuses). Download "
            "the model again, preferably its .safetensors files."
        ) from None


class _TensorDict(dict):
    """A ``.bin`` file's tensors behind safetensors' reader interface."""

    def get_tensor(self, name: str) -> torch.Tensor:
        return self[name]


def layer_of(name: str) -> str | None:
    match = _LAYER_INDEX.search(name)
    return match.group(1) if match else None
