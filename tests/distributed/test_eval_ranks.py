"""Eval loss is the same on any number of ranks: samples that the ranks' shares repeat are counted once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import quickstart_corpus

MODEL = {"d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 512, "max_seq_len": 32, "no_bias": True}


def eval_loss(data: str, folder: str, batch_size: int) -> float:
    from foundry.data.text import build_text_dataloader
    from foundry.models import MPTCausalLM
    from foundry.trainer import Trainer

    loader = build_text_dataloader(
        device_batch_size=batch_size,
        dataset={"local": data, "split": "val", "shuffle": False, "max_seq_len": 32},
        drop_last=False,
        key_path="eval_loader",
        sample_indices=True,
    )
    torch.manual_seed(0)
    trainer = Trainer(
        model=MPTCausalLM(**MODEL),
        eval_dataloader=loader,
        device="cpu",
        precision="fp32",  # one rank's loss and two ranks' are compared within fp32 round-off
        log_to_console=False,
        run_folder=folder,
    )
    return trainer.eval()["eval"]["loss"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quickstart_corpus(tmp_path_factory)


def test_two_ranks_give_the_eval_loss_of_one_when_the_samples_do_not_split_evenly(ranks, data, tmp_path):
    shards = json.loads((data / "val" / "index.json").read_text())["shards"]
    assert sum(shard["samples"] for shard in shards) % 2 == 1  # the ranks' shares must repeat a sample
    (one,) = ranks.run(1, eval_loss, str(data), str(tmp_path / "one"), 4)
    two = ranks.run(2, eval_loss, str(data), str(tmp_path / "two"), 4)
    assert two[0] == two[1]
    assert abs(two[0] - one) < 1e-6
