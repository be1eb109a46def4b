"""foundry convert consolidate: one file from a sharded checkpoint, the same whatever world size wrote it."""

from __future__ import annotations

import torch
from helpers import assert_nested_close
from safetensors.torch import load_file

from distributed.jobs import train
from foundry.cli import main

NUM_BATCHES = 2


def _consolidated(ranks, world_size: int, fsdp_config: dict | None, folder) -> tuple[dict, dict]:
    save_folder = str(folder / "checkpoints")
    ranks.run(world_size, train, NUM_BATCHES, str(folder), fsdp_config, save_folder=save_folder, save_interval="1ba")
    assert main(["convert", "consolidate", save_folder, str(folder / "model.safetensors")]) == 0
    assert main(["convert", "consolidate", save_folder, str(folder / "full.pt"), "--with-optimizer"]) == 0
    return load_file(folder / "model.safetensors"), torch.load(folder / "full.pt", weights_only=True)


def test_two_rank_full_shard_checkpoint_consolidates_like_one_rank(ranks, tmp_path):
    sharded_weights, sharded_full = _consolidated(ranks, 2, {"sharding_strategy": "FULL_SHARD"}, tmp_path / "two")
    weights, full = _consolidated(ranks, 1, None, tmp_path / "one")
    assert "transformer.wte.weight" in weights
    assert_nested_close(sharded_weights, weights, "model.safetensors", atol=1e-5)
    assert_nested_close(sharded_full, full, "full.pt", atol=1e-5)
    assert full["optim"]["state"]  # the optimizer's moments are there
