"""Every file of a checkpoint is checksummed when saved; any damage is caught before anything is read."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from helpers import flip_byte

from foundry.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from foundry.checkpoint.consolidate import consolidate, read_checkpoint_tensors
from foundry.errors import CheckpointError, DamagedCheckpointError

FILE_KINDS = ["__0_0.distcp", ".metadata", "meta.json", "rng-rank0.json", "manifest.json"]


def test_manifest_lists_every_file_with_its_size_and_checksum(tmp_path, trained_state):
    path = save_checkpoint(tmp_path, trained_state)
    manifest = json.loads((path / "manifest.json").read_text())
    files = sorted(p.name for p in path.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == files
    assert all(manifest["files"][name]["bytes"] == (path / name).stat().st_size for name in files)
    assert all(re.fullmatch(r"[0-9a-f]{16}", entry["xxh3_64"]) for entry in manifest["files"].values())


@pytest.mark.parametrize("damaged_file", FILE_KINDS)
def test_a_flipped_byte_is_detected_at_load(tmp_path, trained_state, new_state, damaged_file):
    path = save_checkpoint(tmp_path, trained_state)
    flip_byte(path / damaged_file)
    with pytest.raises(DamagedCheckpointError, match=rf"{path} is damaged: {re.escape(damaged_file)}"):
        load_checkpoint(path, new_state(seed=1))


@pytest.mark.parametrize("damaged_file", FILE_KINDS)
def test_a_flipped_byte_is_detected_at_consolidate(tmp_path, trained_state, damaged_file):
    path = save_checkpoint(tmp_path / "ckpt", trained_state)
    flip_byte(path / damaged_file)
    with pytest.raises(DamagedCheckpointError, match=rf"{re.escape(damaged_file)}"):
        consolidate(path, tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()


def test_a_truncated_file_is_named_with_its_sizes(tmp_path, trained_state, new_state):
    path = save_checkpoint(tmp_path, trained_state)
    data_file = path / "__0_0.distcp"
    size = data_file.stat().st_size
    data_file.write_bytes(data_file.read_bytes()[: size // 2])
    with pytest.raises(DamagedCheckpointError, match=rf"__0_0.distcp has {size // 2} bytes where {size} were written"):
        load_checkpoint(path, new_state())


def test_the_damage_message_names_the_other_checkpoints_and_the_fix(tmp_path, trained_state, train_steps):
    save_checkpoint(tmp_path, trained_state)
    newest = save_checkpoint(tmp_path, train_steps(trained_state, 1))
    flip_byte(newest / "meta.json")
    with pytest.raises(DamagedCheckpointError) as caught:
        read_checkpoint_tensors(tmp_path)  # a save_folder: its latest, which is damaged; never an older one
    message = str(caught.value)
    assert "Other checkpoints in" in message and "ep0-ba3" in message
    assert "load_path" in message and "autoresume" in message


def test_a_damaged_file_is_found_again_after_an_intact_read(tmp_path, trained_state, new_state):
    path = save_checkpoint(tmp_path, trained_state)
    load_checkpoint(path, new_state())  # verified once: the result is remembered only while the files are unchanged
    flip_byte(path / "__0_0.distcp")
    with pytest.raises(DamagedCheckpointError):
        load_checkpoint(path, new_state())


def test_a_checkpoint_of_an_older_foundry_loads_with_a_warning(tmp_path, trained_state, new_state, caplog):
    path = save_checkpoint(tmp_path, trained_state)
    (path / "manifest.json").unlink()
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "format_version": 1}))
    resumed = new_state(seed=1)
    with caplog.at_level(logging.WARNING, logger="foundry"):
        load_checkpoint(path, resumed)
    assert torch.equal(resumed.model[0].weight, trained_state.model[0].weight)
    assert "without checksums" in caplog.text


def test_latest_is_the_checkpoint_published_last_whatever_the_pointer_says(
    tmp_path, trained_state, new_state, train_steps
):
    save_checkpoint(tmp_path, trained_state)  # ep0-ba3
    save_checkpoint(tmp_path, train_steps(trained_state, 5))  # ep0-ba8
    rewound = train_steps(new_state(), 1)  # ep0-ba1: an older name, published last
    newest = save_checkpoint(tmp_path, rewound)
    (tmp_path / "latest").write_text("ep0-ba3")  # as if killed before the pointer was updated
    assert latest_checkpoint(tmp_path) == newest


def test_a_damaged_checkpoint_is_refused_where_eval_and_to_hf_read_models(tmp_path):
    from foundry.convert.checkpoint_io import load_checkpoint_model, save_weights_checkpoint
    from foundry.models.build import build_model

    section = {"name": "mpt_causal_lm", "d_model": 16, "n_heads": 2, "n_layers": 1, "vocab_size": 32, "max_seq_len": 8}
    folder = save_weights_checkpoint(build_model(section), tmp_path, {"model": section}, overwrite=False)
    flip_byte(folder / "__0_0.distcp")
    with pytest.raises(DamagedCheckpointError, match=r"__0_0.distcp differs from its checksum"):
        load_checkpoint_model(folder, section)


def test_a_crafted_checkpoint_whose_manifest_matches_gives_a_message_not_a_traceback(tmp_path, trained_state, resealed):
    path = save_checkpoint(tmp_path / "ckpt", trained_state)
    data_file = path / "__0_0.distcp"
    data_file.write_bytes(data_file.read_bytes()[:40])  # truncated, and the manifest rewritten to match
    resealed(path)
    with pytest.raises(CheckpointError, match=r"Cannot read the tensors of checkpoint .*ep0-ba3.*consolidate another"):
        consolidate(path, tmp_path / "model.safetensors")


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, trained_state):
    from foundry.checkpoint.integrity import manifest_text

    path = save_checkpoint(tmp_path / "ckpt", trained_state)
    outside = {"../elsewhere": {"bytes": 1, "xxh3_64": "0"}}
    (path / "manifest.json").write_text(manifest_text(outside, sequence=1))
    with pytest.raises(DamagedCheckpointError, match=r"manifest.json lists an entry that is not a file of this folder"):
        load_checkpoint(path, trained_state)
