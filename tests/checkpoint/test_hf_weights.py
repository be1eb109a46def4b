"""Reading a Hugging Face folder's weight files one at a time, a layer at a time (``foundry.checkpoint.hf_weights``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from foundry.checkpoint.hf_weights import layers_of_folder
from foundry.errors import CheckpointError

FILES = {  # layer 1 spans two files
    "model-00001-of-00002.safetensors": ["model.embed_tokens.weight", "model.layers.0.q.weight",
                                         "model.layers.0.k.weight", "model.layers.1.q.weight"],
    "model-00002-of-00002.safetensors": ["model.layers.1.k.weight", "model.norm.weight", "lm_head.weight"],
}  # fmt: skip


def write_sharded(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {
        name: torch.full((2,), float(i)) for i, name in enumerate(name for names in FILES.values() for name in names)
    }
    for file, names in FILES.items():
        save_file({name: tensors[name] for name in names}, folder / file)
    weight_map = {name: file for file, names in FILES.items() for name in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


def test_each_layer_comes_whole_and_once_across_files(tmp_path: Path) -> None:
    tensors = write_sharded(tmp_path)
    save_file({"stale.weight": torch.zeros(1)}, tmp_path / "model.safetensors")  # an older save, not in the index
    groups = [{name: tensor.tolist() for name, tensor in group.items()} for group in layers_of_folder(tmp_path)]
    assert [sorted(group) for group in groups] == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.k.weight", "model.layers.0.q.weight"],
        ["lm_head.weight"],
        ["model.layers.1.k.weight", "model.layers.1.q.weight"],  # once its second file is read
        ["model.norm.weight"],
    ]
    assert {name: value for group in groups for name, value in group.items()} == {
        name: tensor.tolist() for name, tensor in tensors.items()
    }


@pytest.mark.parametrize("zip_format", [True, False], ids=["torch-1.6+", "legacy"])
def test_pytorch_bin_files_read_alike_in_either_format(tmp_path: Path, zip_format: bool) -> None:
    state = {"model.layers.0.q.weight": torch.ones(2), "lm_head.weight": torch.zeros(3)}
    torch.save(state, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=zip_format)
    groups = list(layers_of_folder(tmp_path))
    assert [list(group) for group in groups] == [["model.layers.0.q.weight"], ["lm_head.weight"]]
    assert torch.equal(groups[1]["lm_head.weight"], state["lm_head.weight"])


def test_a_damaged_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*Download the model again"):
        list(layers_of_folder(tmp_path))


def test_a_folder_without_weights_says_so(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no weights \(\*\.safetensors or pytorch_model\*\.bin\)"):
        list(layers_of_folder(tmp_path))


def test_a_tensor_in_two_files_without_an_index_is_refused(tmp_path: Path) -> None:
    save_file({"model.layers.0.q.weight": torch.ones(2)}, tmp_path / "model-00001-of-00001.safetensors")
    save_file({"model.layers.0.q.weight": torch.zeros(2)}, tmp_path / "model.safetensors")  # an older save
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.q\.weight' in both model-00001-of-00001"):
        list(layers_of_folder(tmp_path))
