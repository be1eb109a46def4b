"""Streaming's shared memory on 2 gloo ranks: a node's ranks share their leader's prefix, and two launchers that make
one job on one host (one rank per node, each its node's leader) build their datasets without waiting on each other."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from streaming import MDSWriter

from foundry.data import build_text_dataloader
from foundry.data.config import FinetuningDatasetConfig
from foundry.data.finetuning_rows import read_rows

TWO_LAUNCHERS = {"LOCAL_WORLD_SIZE": "1"}  # `foundry train --nnodes 2 --nproc 1` twice on one host


@pytest.fixture(scope="module")
def mds_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 samples of 8 tokens, and the same rows as finetuning turns."""
    local = tmp_path_factory.mktemp("mds")
    with MDSWriter(out=str(local / "train"), columns={"tokens": "ndarray:int32"}) as writer:
        for index in range(4):
            writer.write({"tokens": np.arange(index * 8, (index + 1) * 8, dtype=np.int32)})
    with MDSWriter(out=str(local / "turns"), columns={"turns": "json"}) as writer:
        for index in range(4):
            writer.write({"turns": [{"input_ids": [index, 1], "labels": [2]}]})
    return local


def text_prefix_and_batch_rows(local: str) -> tuple[int, int]:
    """This rank's text dataset's shared-memory prefix, and the rows of its first batch."""
    dataset = {"local": local, "split": "train", "max_seq_len": 8}
    loader = build_text_dataloader(tokenizer=None, device_batch_size=2, dataset=dataset)
    try:
        return loader.dataset._shm_prefix_int, next(iter(loader))["input_ids"].shape[0]
    finally:
        loader.dataset.close()


def finetuning_rows_read(local: str) -> int:
    config = FinetuningDatasetConfig(max_seq_len=8, local=local, split="turns")
    return len(list(read_rows(config, "train_loader.dataset")))


def test_the_ranks_of_one_node_share_their_leaders_prefix(ranks, mds_folder: Path) -> None:
    (leader, leader_rows), (second, second_rows) = ranks.run(2, text_prefix_and_batch_rows, str(mds_folder))
    assert leader == second
    assert leader_rows == second_rows == 2


def test_two_launchers_on_one_host_each_elect_a_prefix_without_deadlock(ranks, mds_folder: Path) -> None:
    (first, first_rows), (second, second_rows) = ranks.run(
        2, text_prefix_and_batch_rows, str(mds_folder), env=TWO_LAUNCHERS
    )
    assert first != second
    assert first_rows == second_rows == 2
    assert ranks.run(2, finetuning_rows_read, str(mds_folder), env=TWO_LAUNCHERS) == [4, 4]
