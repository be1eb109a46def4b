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


def two_ranks_and_one(ranks, tmp_path, init_device: str) -> tuple[dict, dict]:
    model_keys = {**QLORA_LLAMA, "init_device": init_device}
    one = ranks.run(1, train, NUM_BATCHES, str(tmp_path / "one"), None, model_keys=model_keys)[0]
    fsdp_config = {"sharding_strategy": "FULL_SHARD"}
    two = ranks.run(2, train, NUM_BATCHES, str(tmp_path / "two"), fsdp_config, model_keys=model_keys)[0]
    assert sorted(two["losses"]) == list(range(1, NUM_BATCHES + 1))
    assert two["weights"].keys() == one["weights"].keys()
    assert any(not torch.equal(w, 0 * w) for n, w in two["weights"].items() if ".lora_B." in n)  # adapters trained
    return one, two


def test_qlora_on_two_full_shard_ranks_matches_one_rank(ranks, tmp_path):
    one, two = two_ranks_and_one(ranks, tmp_path, "cpu")
    for step, loss in one["losses"].items():
        assert two["losses"][step] == pytest.approx(loss, abs=1e-5), step
    for name, weight in one["weights"].items():
        if is_adapter_key(name):  # Adam divides by sqrt(v): round-off in tiny gradients grows to ~1e-5
            torch.testing.assert_close(two["weights"][name], weight, atol=5e-5, rtol=0, msg=name)
        else:  # the NF4 codes went through FSDP2's shards and all-gathers unchanged
            assert torch.equal(two["weights"][name], weight), name


def test_qlora_built_on_meta_trains_on_two_ranks_from_rank_0s_weights(ranks, tmp_path):
    # Each rank quantizes its shard of rank 0's bf16 values: NF4's second-level scales are centred on the mean of
    # the shard's scales, not the whole weight's, so a base weight may differ from one rank's in its last bit.
    # Adam's first steps follow the sign of near-zero gradients, so the adapters are compared through the loss.
    one, two = two_ranks_and_one(ranks, tmp_path, "meta")
    for step, loss in one["losses"].items():
        assert two["losses"][step] == pytest.approx(loss, abs=1e-3), step
    for name, weight in one["weights"].items():
        if not is_adapter_key(name):
            bf16_step = 2.0 ** (torch.frexp(weight.abs().max().float()).exponent.item() - 8)
            torch.testing.assert_close(two["weights"][name], weight, atol=bf16_step, rtol=0, msg=name)
