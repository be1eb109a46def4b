"""QLoRA under FSDP2: NF4 base weights sharded and gathered in 4 bits, fp32 adapters, train as one process does."""

from __future__ import annotations

import pytest
import torch

from distributed.jobs import train
from foundry.models.lora import is_adapter_key

pytest.importorskip("torchao")

NUM_BATCHES = 4
# 256 wide: each rank's half of every adapted weight is whole NF4 scale blocks (64 × 256 weights).
QLORA_LLAMA = {
    "name": "llama_causal_lm", "d_model": 256, "n_layers": 2, "n_heads": 4, "kv_n_heads": 2, "vocab_size": 64,
    "max_seq_len": 16, "multiple_of": 256, "ffn_dim_multiplier": None, "rope_theta": 10000.0,
    "peft_config": {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "quantize_base": True},
}  # fmt: skip


def test_qlora_on_two_full_shard_ranks_matches_one_rank(ranks, tmp_path):
    one = ranks.run(1, train, NUM_BATCHES, str(tmp_path / "one"), None, model_keys=QLORA_LLAMA)[0]
    fsdp_config = {"sharding_strategy": "FULL_SHARD"}
    two = ranks.run(2, train, NUM_BATCHES, str(tmp_path / "two"), fsdp_config, model_keys=QLORA_LLAMA)[0]
    assert sorted(two["losses"]) == list(range(1, NUM_BATCHES + 1))
    for step, loss in one["losses"].items():
        assert two["losses"][step] == pytest.approx(loss, abs=1e-5), step
    assert two["weights"].keys() == one["weights"].keys()
    for name, weight in one["weights"].items():
        if is_adapter_key(name):  # Adam divides by sqrt(v): round-off in tiny gradients grows to ~1e-5
            torch.testing.assert_close(two["weights"][name], weight, atol=5e-5, rtol=0, msg=name)
        else:  # the NF4 codes went through FSDP2's shards and all-gathers unchanged
            assert torch.equal(two["weights"][name], weight), name
    assert any(not torch.equal(w, 0 * w) for n, w in two["weights"].items() if ".lora_B." in n)  # adapters trained
