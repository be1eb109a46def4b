"""A run killed with SIGKILL in the middle of saving still resumes from its last complete checkpoint.

The child processes print after each complete checkpoint; the test kills them right after the first.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from foundry.checkpoint import latest_checkpoint, load_checkpoint
from foundry.checkpoint.consolidate import read_checkpoint_tensors
from foundry.core import Callback, State, Time
from foundry.distributed import destroy_process_group
from foundry.trainer import Trainer

REPO_ROOT = Path(__file__).resolve().parents[2]

# Saves forever; each checkpoint's weights all equal its batch number, so a load can be checked.
SAVE_LOOP = textwrap.dedent(
    """
    import sys
    import torch
    from foundry.checkpoint import save_checkpoint
    from foundry.core import State, Time

    model = torch.nn.Linear(1024, 2048, bias=False)  # 8 MiB: each save takes a while to write
    state = State(model=model, max_duration=Time.parse("100000ba"))
    while True:
        state.timestamp = state.timestamp.after_batch(samples=1, tokens=1, duration_s=0.0)
        with torch.no_grad():
            model.weight.fill_(state.timestamp.batch)
        save_checkpoint(sys.argv[1], state, num_to_keep=2)
        print(state.timestamp.batch, flush=True)
    """
)


def test_sigkill_during_save_leaves_a_loadable_latest_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    child = subprocess.Popen(
        [sys.executable, "-c", SAVE_LOOP, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    try:
        first_saved = child.stdout.readline()  # blocks until the first checkpoint is complete
        assert first_saved.strip() == b"1", child.stderr.read().decode()
        os.kill(child.pid, signal.SIGKILL)  # the child is now inside its second save
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()

    latest = latest_checkpoint(tmp_path)
    assert latest is not None
    state = State(model=torch.nn.Linear(1024, 2048, bias=False), max_duration=Time.parse("1ba"))
    load_checkpoint(latest, state)
    assert state.timestamp.batch >= 1
    assert torch.all(state.model.weight == state.timestamp.batch)


# The same through the Trainer: it checkpoints every batch and prints each published checkpoint's name.
TRAINER_LOOP = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, sys.argv[3])
    from test_checkpoint_sigkill import build_trainer

    build_trainer(sys.argv[1], save_async=sys.argv[2] == "async", max_batches=100000, announce=True).fit()
    """
)


class _Squares(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(1024, 2048, bias=False)  # 8 MiB, 24 MiB with Adam's moments

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.linear(batch).pow(2).mean()


class _Announce(Callback):
    def batch_checkpoint(self, state, logger) -> None:
        print(Path(state.last_checkpoint_path).name, flush=True)


def build_trainer(save_folder: str, save_async: bool, max_batches: int, announce: bool = False) -> Trainer:
    torch.manual_seed(0)
    return Trainer(
        model=_Squares(),
        train_dataloader=[torch.randn(2, 1024, generator=torch.Generator().manual_seed(i)) for i in range(8)],
        max_duration=f"{max_batches}ba",
        save_folder=save_folder,
        save_interval="1ba",
        save_num_checkpoints_to_keep=2,
        save_async=save_async,
        autoresume=True,
        run_folder=f"{save_folder}/../run",
        log_to_console=False,
        callbacks=[_Announce()] if announce else [],
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trainer_autoresumes_from_the_last_complete_checkpoint_after_sigkill(tmp_path, mode):
    save_folder = tmp_path / "checkpoints"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-c", TRAINER_LOOP, str(save_folder), mode, str(Path(__file__).parent)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        first_published = child.stdout.readline()  # blocks until the first checkpoint is published
        os.kill(child.pid, signal.SIGKILL)  # the child is now training on or writing a later checkpoint
    finally:
        child.kill()
        child.wait(timeout=30)
        errors = child.stderr.read().decode()
        child.stdout.close()
        child.stderr.close()
    assert first_published.strip() == b"ep0-ba1", errors

    latest = latest_checkpoint(save_folder)
    assert latest is not None
    saved = read_checkpoint_tensors(latest)["model"]
    resumed = build_trainer(str(save_folder), save_async=mode == "async", max_batches=10000)
    try:
        assert resumed.state.last_checkpoint_path == str(latest)
        assert f"ba{resumed.state.timestamp.batch}" == latest.name.split("-")[1]
        resumed_weight = resumed.state.model.state_dict()["module.linear.weight"]
        assert torch.equal(resumed_weight.cpu(), saved["module.linear.weight"])  # the run trains on a GPU if any
    finally:
        destroy_process_group()  # save_async joined a process group of one
