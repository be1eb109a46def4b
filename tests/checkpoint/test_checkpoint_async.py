"""save_async: checkpoints written in the background equal synchronous ones and are published by fit's end."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyLM, assert_nested_close, token_batches

from foundry.checkpoint import latest_checkpoint
from foundry.checkpoint.consolidate import read_checkpoint_tensors
from foundry.distributed import destroy_process_group
from foundry.trainer import Trainer

NUM_BATCHES = 3


@pytest.fixture(autouse=True)
def _leave_no_process_group():
    yield
    destroy_process_group()  # save_async joined a process group of one; later tests expect none


def _fit(folder, **kwargs) -> Trainer:
    torch.manual_seed(0)
    trainer = Trainer(
        model=TinyLM(),
        train_dataloader=token_batches(NUM_BATCHES, batch_size=4),
        max_duration=f"{NUM_BATCHES}ba",
        save_folder=str(folder / "checkpoints"),
        save_interval="1ba",
        run_folder=str(folder / "run"),
        log_to_console=False,
        **kwargs,
    )
    trainer.fit()
    return trainer


def test_async_checkpoints_equal_synchronous_ones(tmp_path):
    _fit(tmp_path / "sync")
    _fit(tmp_path / "async", save_async=True)
    for batch in range(1, NUM_BATCHES + 1):
        name = f"ep0-ba{batch}"
        want = read_checkpoint_tensors(tmp_path / "sync" / "checkpoints" / name)
        got = read_checkpoint_tensors(tmp_path / "async" / "checkpoints" / name)
        assert_nested_close(got, want, name)


def test_fit_end_publishes_the_pending_async_save(tmp_path):
    trainer = _fit(tmp_path, save_async=True)
    latest = latest_checkpoint(tmp_path / "checkpoints")
    assert latest is not None and latest.name == f"ep0-ba{NUM_BATCHES}"
    assert trainer.state.last_checkpoint_path == str(latest)
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))
