"""An interrupted save never leaves a checkpoint that looks complete, and never costs the previous one."""

from __future__ import annotations

import errno
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from foundry.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from foundry.errors import CheckpointError


def _leftovers(folder) -> list[str]:
    return [path.name for path in folder.iterdir() if path.name.startswith(".tmp-")]


def test_tmp_leftover_is_ignored_and_previous_checkpoint_loads(tmp_path, trained_state, new_state):
    previous = save_checkpoint(tmp_path, trained_state)
    partial = tmp_path / ".tmp-ep0-ba9-deadbeef"
    partial.mkdir()
    (partial / "meta.json").write_text("{}")
    assert latest_checkpoint(tmp_path) == previous
    resumed = new_state(seed=1)
    load_checkpoint(tmp_path, resumed)
    assert torch.equal(resumed.model[0].weight, trained_state.model[0].weight)


def test_next_save_removes_tmp_leftovers(tmp_path, trained_state):
    (tmp_path / ".tmp-ep0-ba9-deadbeef").mkdir()
    (tmp_path / ".tmp-latest-deadbeef").write_text("ep0-ba9")
    save_checkpoint(tmp_path, trained_state)
    assert _leftovers(tmp_path) == []


def test_crash_mid_write_keeps_previous_latest_and_no_partial_checkpoint(
    tmp_path, trained_state, train_steps, monkeypatch
):
    previous = save_checkpoint(tmp_path, trained_state)

    def write_half_then_fail(self, plan, planner):
        (tmp_path / _leftovers(tmp_path)[0] / "__0_0.distcp").write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", write_half_then_fail)
    with pytest.raises(CheckpointError, match=r"Could not write checkpoint .*ep0-ba4.*No space left"):
        save_checkpoint(tmp_path, train_steps(trained_state, 1))
    assert latest_checkpoint(tmp_path) == previous
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ep0-ba3", "latest"]


@pytest.mark.parametrize(
    ("error", "free_bytes"),
    [(OSError(errno.ENOSPC, "No space left on device"), 10 << 30), (RuntimeError("unexpected pos 704 vs 598"), 4096)],
    ids=["ENOSPC", "torch's zip writer on a full disk"],
)
def test_a_full_disk_says_no_space_left_naming_the_folder(tmp_path, trained_state, monkeypatch, error, free_bytes):
    def fail(self, plan, planner):
        raise error

    monkeypatch.setattr(dcp.FileSystemWriter, "write_data", fail)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(100 << 30, 100 << 30, free_bytes))
    with pytest.raises(CheckpointError, match=rf"ep0-ba3: no space left on device in {tmp_path} .*larger disk"):
        save_checkpoint(tmp_path, trained_state)
