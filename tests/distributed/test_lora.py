"""LoRA under FSDP2: frozen base and trainable adapters sharded in the same units train as one process does."""

from __future__ import annotations

import pytest
import torch

from distributed.jobs import train

NUM_BATCHES = 4
LORA_KEYS = {"peft_config": {"r": 4, "lora_alpha": 8, "target_modules": ["Wqkv", "out_proj", "up_proj", "down_proj"]}}


def test_lora_on_two_full_shard_ranks_matches_one_rank(ranks, tmp_path):
    one = ranks.run(1, train, NUM_BATCHES, str(tmp_path / "one"), None, model_keys=LORA_KEYS)[0]
    two = ranks.run(
        2, train, NUM_BATCHES, str(tmp_path / "two"), {"sharding_strategy": "FULL_SHARD"}, model_keys=LORA_KEYS
    )[0]
    assert sorted(two["losses"]) == list(range(1, NUM_BATCHES + 1))
    for step, loss in one["losses"].items():
        assert two["losses"][step] == pytest.approx(loss, abs=1e-5), step
    assert two["weights"].keys() == one["weights"].keys()
    for name, weight in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], weight, atol=1e-5, rtol=0, msg=name)
    assert any(not torch.equal(w, 0 * w) for n, w in two["weights"].items() if ".lora_B." in n)  # adapters trained
