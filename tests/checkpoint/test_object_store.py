"""Checkpoints in an object-store save_folder, against a real S3-protocol server on localhost (moto's)."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import TinyLM, token_batches

from foundry.checkpoint.object_store import ObjectStore
from foundry.checkpoint.remote import local_copy, published_checkpoints, store_checkpoints
from foundry.trainer import Trainer


def _trainer(save_folder: str, tmp_path: Path, max_batches: int = 3, **kwargs) -> Trainer:
    torch.manual_seed(0)
    return Trainer(
        model=TinyLM(),
        train_dataloader=token_batches(6, 4),
        max_duration=f"{max_batches}ba",
        save_folder=save_folder,
        save_interval="1ba",
        device="cpu",
        run_folder=str(tmp_path / "run"),
        log_to_console=False,
        **kwargs,
    )


def test_a_run_publishes_each_checkpoint_on_the_store_and_keeps_the_newest(s3_bucket, tmp_path):
    url = f"{s3_bucket}/runs/a"
    _trainer(url, tmp_path, save_num_checkpoints_to_keep=2).fit()
    store = ObjectStore(url)
    assert [name for name, _ in published_checkpoints(store)] == ["ep0-ba2", "ep0-ba3"]
    assert set(store_checkpoints(store)) == {"ep0-ba2", "ep0-ba3"}
    assert store.read_bytes("latest") == b"ep0-ba3"
    assert sorted(path.name for path in local_copy(url).iterdir() if path.is_dir()) == ["ep0-ba2", "ep0-ba3"]
