"""A checkpoint saved by N ranks loads into M ranks (any layout) and training continues exactly."""

from __future__ import annotations

import pytest
import torch

from distributed.jobs import train
from foundry.callbacks.hand_over import HandOver

NUM_BATCHES = 6
PLAIN = None  # no fsdp_config: the plain module on one rank
FULL_SHARD = {"sharding_strategy": "FULL_SHARD"}
REPLICATED = {"sharding_strategy": "NO_SHARD"}  # a 2-D (replicate, shard) mesh


@pytest.fixture(scope="module")
def uninterrupted(ranks, tmp_path_factory) -> dict:
    return ranks.run(1, train, NUM_BATCHES, str(tmp_path_factory.mktemp("uninterrupted")))[0]


@pytest.mark.parametrize(
    ("saved_by", "loaded_by"),
    [
        ((1, PLAIN), (2, FULL_SHARD)),
        ((2, FULL_SHARD), (1, PLAIN)),
        ((2, FULL_SHARD), (2, REPLICATED)),
        ((1, FULL_SHARD), (1, PLAIN)),
    ],
    ids=["1-plain-to-2-sharded", "2-sharded-to-1-plain", "2-sharded-to-2-replicated", "1-sharded-to-1-plain"],
)
def test_checkpoint_loads_into_another_world_size(ranks, uninterrupted, saved_by, loaded_by, tmp_path):
    relaunch = {"callbacks": [HandOver("3ba")], "save_folder": str(tmp_path / "ckpt"), "autoresume": True}
    first = ranks.run(saved_by[0], train, NUM_BATCHES, str(tmp_path), saved_by[1], **relaunch)[0]
    second = ranks.run(loaded_by[0], train, NUM_BATCHES, str(tmp_path), loaded_by[1], **relaunch)[0]
    assert (first["batch"], second["batch"]) == (3, NUM_BATCHES)
    assert sorted(second["losses"]) == [4, 5, 6]
    for step, loss in second["losses"].items():
        assert loss == pytest.approx(uninterrupted["losses"][step], abs=1e-5), step
    for name, weight in uninterrupted["weights"].items():
        torch.testing.assert_close(second["weights"][name], weight, atol=1e-5, rtol=0, msg=name)
