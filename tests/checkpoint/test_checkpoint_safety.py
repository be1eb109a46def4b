"""Loading a checkpoint never runs code hidden in its pickles."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import repo_pythonpath
from torch.distributed.checkpoint.state_dict import get_state_dict

from foundry.checkpoint import SafeFileSystemReader, load_checkpoint, save_checkpoint
from foundry.errors import CheckpointError, DamagedCheckpointError

# The tests call DCP directly, which warns that it runs without a process group.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


class RunsCommand:
    """Unpickling this object runs a shell command: what a malicious checkpoint would contain."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_malicious_metadata_is_refused_and_not_executed(tmp_path, trained_state, new_state, resealed):
    path = save_checkpoint(tmp_path, trained_state)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    resealed(path)  # a crafted checkpoint comes with a manifest that matches its files
    with pytest.raises(CheckpointError, match=r"Refusing to load .*\.metadata.*system"):
        load_checkpoint(path, new_state())
    assert not marker.exists()


def test_malicious_optimizer_value_is_refused_and_not_executed(tmp_path, trained_state, new_state, resealed):
    path = save_checkpoint(tmp_path, trained_state)
    marker = tmp_path / "pwned"
    model_state, optim_state = get_state_dict(trained_state.model, trained_state.optimizers)
    optim_state["param_groups"][0]["lr"] = RunsCommand(f"touch {marker}")
    dcp.save({"model": model_state, "optim": optim_state}, storage_writer=dcp.FileSystemWriter(path))
    resealed(path)
    refused = r"Refusing to load checkpoint value 'optim\.param_groups\.0\.lr'.*\.system"
    with pytest.raises(CheckpointError, match=refused):
        load_checkpoint(path, new_state())
    assert not marker.exists()


def test_a_tampered_file_without_a_matching_manifest_is_refused_before_unpickling(tmp_path, trained_state, new_state):
    path = save_checkpoint(tmp_path, trained_state)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    with pytest.raises(DamagedCheckpointError, match=r"\.metadata has \d+ bytes where \d+ were written"):
        load_checkpoint(path, new_state())
    assert not marker.exists()


def test_reader_refuses_dcp_default_planner(tmp_path, trained_state):
    path = save_checkpoint(tmp_path, trained_state)
    state_dict = {"model": dict(trained_state.model.state_dict())}
    with pytest.raises(dcp.CheckpointException, match="SafeLoadPlanner"):
        dcp.load(state_dict, storage_reader=SafeFileSystemReader(path))


def test_real_metadata_passes_the_allowlist(tmp_path, trained_state):
    path = save_checkpoint(tmp_path, trained_state)
    metadata = SafeFileSystemReader(path).read_metadata()
    assert metadata.state_dict_metadata["model.0.weight"].size == torch.Size([8, 4])


def test_convert_consolidate_refuses_malicious_metadata_with_one_message_and_no_traceback(
    tmp_path, trained_state, resealed
):
    path = save_checkpoint(tmp_path, trained_state)
    marker = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(RunsCommand(f"touch {marker}")))
    resealed(path)
    command = [sys.executable, "-m", "foundry.cli", "convert", "consolidate", str(path), str(tmp_path / "out")]
    # A process of its own: pytest's log capture would hide what torch's logger prints to stderr.
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": repo_pythonpath()})
    assert done.returncode == 2
    stderr = done.stderr
    assert "Refusing to load" in stderr and ".metadata" in stderr
    assert "Traceback" not in stderr and "Falling back" not in stderr
    assert not marker.exists()
