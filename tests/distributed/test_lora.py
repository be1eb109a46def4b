"""LoRA under FSDP2: frozen base and trainable adapters sharded in the same units train as one process does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distributed.jobs import assert_same_run, train

NUM_BATCHES = 4
LORA_KEYS = {"peft_config": {"r": 4, "lora_alpha": 8, "target_modules": ["Wqkv", "out_proj", "up_proj", "down_proj"]}}


def assert_two_full_shard_ranks_match_one(ranks, tmp_path, model_keys: dict[str, Any]) -> None:
    one = ranks.run(1, train, NUM_BATCHES, str(tmp_path / "one"), None, model_keys=model_keys)[0]
    two = ranks.run(
        2, train, NUM_BATCHES, str(tmp_path / "two"), {"sharding_strategy": "FULL_SHARD"}, model_keys=model_keys
    )[0]
    assert sorted(one["losses"]) == list(range(1, NUM_BATCHES + 1))
    assert_same_run(two, one)
    assert any(not torch.equal(w, 0 * w) for n, w in two["weights"].items() if ".lora_B." in n)  # adapters trained


def test_lora_on_two_full_shard_ranks_matches_one_rank(ranks, tmp_path):
    assert_two_full_shard_ranks_match_one(ranks, tmp_path, LORA_KEYS)


def test_hf_causal_lm_lora_on_two_full_shard_ranks_matches_one_rank(ranks, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=16,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    peft_config = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    model = {"name": "hf_causal_lm", "pretrained_model_name_or_path": str(tmp_path / "hf"), "peft_config": peft_config}
    assert_two_full_shard_ranks_match_one(ranks, tmp_path, model)


@pytest.mark.parametrize("mixed_precision", ["PURE", "FULL"])
def test_bf16_base_on_two_full_shard_ranks_matches_one_rank(ranks, tmp_path, mixed_precision):
    keys = {"peft_config": {**LORA_KEYS["peft_config"], "base_dtype": "bfloat16"}}
    one = ranks.run(1, train, NUM_BATCHES, str(tmp_path / "one"), None, model_keys=keys, precision="amp_bf16")[0]
    fsdp_config = {"sharding_strategy": "FULL_SHARD", "mixed_precision": mixed_precision}
    two = ranks.run(2, train, NUM_BATCHES, str(tmp_path / "two"), fsdp_config, model_keys=keys, precision="amp_bf16")[0]
    assert two["weights"]["transformer.blocks.0.attn.Wqkv.weight"].dtype == torch.bfloat16
    assert_same_run(two, one, tolerance=1e-2)  # bf16 GEMMs summed in another order
