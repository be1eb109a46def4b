"""Where checkpoints go and how they are found: names, `latest`, pruning, overwrite, resolving load paths."""

from __future__ import annotations

import re

import pytest

from foundry.checkpoint import latest_checkpoint, resolve_checkpoint_path, save_checkpoint
from foundry.errors import CheckpointError, DamagedCheckpointError


def _checkpoint_names(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.startswith("ep"))


def test_checkpoint_is_named_by_epoch_and_batch(tmp_path, trained_state):
    path = save_checkpoint(tmp_path, trained_state)
    assert path == tmp_path / "ep0-ba3"
    assert (tmp_path / "latest").read_text() == "ep0-ba3"


def test_pruning_keeps_the_newest_n(tmp_path, trained_state, train_steps):
    for _ in range(4):
        save_checkpoint(tmp_path, train_steps(trained_state, 1), num_to_keep=2)
    assert _checkpoint_names(tmp_path) == ["ep0-ba6", "ep0-ba7"]


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path, trained_state, new_state, train_steps):
    save_checkpoint(tmp_path, trained_state)  # ep0-ba3
    save_checkpoint(tmp_path, train_steps(new_state(), 1), num_to_keep=1)  # ep0-ba1: older name, newest write
    assert _checkpoint_names(tmp_path) == ["ep0-ba1"]


def test_existing_checkpoint_is_an_error_naming_save_overwrite(tmp_path, trained_state):
    save_checkpoint(tmp_path, trained_state)
    with pytest.raises(CheckpointError, match=r"ep0-ba3 already exists.*save_overwrite"):
        save_checkpoint(tmp_path, trained_state)


def test_overwrite_replaces_the_existing_checkpoint(tmp_path, trained_state):
    first = save_checkpoint(tmp_path, trained_state, config={"version": 1})
    save_checkpoint(tmp_path, trained_state, config={"version": 2}, overwrite=True)
    assert '"version": 2' in (first / "meta.json").read_text()
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".tmp")] == []


def test_latest_falls_back_to_newest_name_when_pointer_is_stale(tmp_path, trained_state, train_steps):
    save_checkpoint(tmp_path, trained_state)
    save_checkpoint(tmp_path, train_steps(trained_state, 7))  # ep0-ba10: sorts after ba3 by number
    (tmp_path / "latest").write_text("ep0-ba99")
    assert latest_checkpoint(tmp_path) == tmp_path / "ep0-ba10"


def test_latest_of_empty_or_missing_folder_is_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "absent") is None


def test_resolve_save_folder_gives_its_latest(tmp_path, trained_state, train_steps):
    save_checkpoint(tmp_path, trained_state)
    newest = save_checkpoint(tmp_path, train_steps(trained_state, 1))
    assert resolve_checkpoint_path(tmp_path) == newest
    assert resolve_checkpoint_path(str(newest)) == newest


def test_resolve_missing_path_names_it(tmp_path):
    with pytest.raises(CheckpointError, match=r"No checkpoint at .*absent.*load_path"):
        resolve_checkpoint_path(tmp_path / "absent")


def test_resolve_folder_without_checkpoints_says_so(tmp_path):
    with pytest.raises(CheckpointError, match=r"holds no checkpoint \(no ep\*-ba\* folder\).*load_path"):
        resolve_checkpoint_path(tmp_path)


@pytest.mark.parametrize("removed", ["meta.json", ".metadata", "rng-rank0.json", "__0_0.distcp", "manifest.json"])
def test_a_missing_file_is_named_as_damage(tmp_path, trained_state, removed):
    path = save_checkpoint(tmp_path, trained_state)
    (path / removed).unlink()
    with pytest.raises(DamagedCheckpointError, match=rf"{path} is damaged: {re.escape(removed)} is missing"):
        resolve_checkpoint_path(path)
