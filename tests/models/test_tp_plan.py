"""MPT's and Llama's tensor-parallel plan, and what it refuses by name before any rank starts."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from foundry.distributed.tensor_parallel import (
    AdaptedColwiseParallel,
    AdaptedRowwiseParallel,
    FusedColwiseParallel,
    SequenceLayout,
)
from foundry.errors import ConfigError
from foundry.models import MPTCausalLM
from foundry.models.llama import LlamaCausalLM
from foundry.models.tp_plan import check_tensor_parallel

MPT = {"d_model": 32, "n_heads": 4, "n_layers": 2, "vocab_size": 64, "max_seq_len": 16}
LLAMA = {**MPT, "kv_n_heads": None, "ffn_hidden_size": 64}


def block_plan(plan: dict) -> dict:
    return {name.removeprefix("transformer.blocks.1."): type(style) for name, style in plan.items() if ".1." in name}


def test_llama_plan_splits_qkv_by_heads_and_each_ffn_linear():
    plan = LlamaCausalLM(**LLAMA).tensor_parallel_plan(2, sequence_parallel=False)
    assert block_plan(plan) == {
        "attn.Wqkv": FusedColwiseParallel, "attn.out_proj": RowwiseParallel,
        "ffn.up_proj": ColwiseParallel, "ffn.gate_proj": ColwiseParallel, "ffn.down_proj": RowwiseParallel,
    }  # fmt: skip
    assert len(plan) == 2 * len(block_plan(plan))


def test_sequence_parallel_plan_splits_the_residual_stream_between_the_split_linears():
    plan = LlamaCausalLM(**LLAMA).tensor_parallel_plan(2, sequence_parallel=True)
    block = block_plan(plan)
    assert {name: block[name] for name in ("norm_1", "norm_2", "attn", "ffn")} == {
        "norm_1": SequenceParallel, "norm_2": SequenceParallel, "attn": SequenceLayout, "ffn": SequenceLayout
    }  # fmt: skip
    assert plan["transformer.blocks.1.attn.out_proj"].output_layouts == (Shard(1),)  # reduce-scattered
    assert (plan["transformer.blocks.0"].split, plan["transformer.norm_f"].split) == (True, False)


def test_lora_layers_split_with_their_adapters():
    lora = {"peft_config": {"r": 2, "target_modules": ["out_proj", "up_proj"]}}
    block = block_plan(LlamaCausalLM(**LLAMA, **lora).tensor_parallel_plan(2, sequence_parallel=False))
    assert (block["attn.out_proj"], block["ffn.up_proj"]) == (AdaptedRowwiseParallel, AdaptedColwiseParallel)
    assert (block["ffn.gate_proj"], block["ffn.down_proj"]) == (ColwiseParallel, RowwiseParallel)  # not adapted


@pytest.mark.parametrize(
    ("keys", "degree", "named"),
    [
        ({"n_heads": 4}, 3, "does not divide model.n_heads \\(4\\)"),
        ({"ffn_config": {"ffn_hidden_size": 66}}, 4, "does not divide the FFN width .* \\(66\\)"),
        ({"attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 2}}, 4, "model.kv_n_heads .* \\(2\\)"),
        ({"attn_config": {"attn_type": "multiquery_attention"}}, 2, "model.kv_n_heads .* \\(1\\)"),
        ({"attn_config": {"alibi": True}, "learned_pos_emb": False}, 2, "model.attn_config.alibi"),
        ({"attn_config": {"qk_ln": True}}, 2, "model.attn_config.qk_ln"),
        ({"peft_config": {"r": 2, "target_modules": ["Wqkv"], "quantize_base": True}}, 2, "quantize_base \\(QLoRA\\)"),
        ({"ffn_config": {"ffn_type": "mb_moe", "moe_num_experts": 2, "moe_top_k": 1}}, 2, "mixture of experts"),
    ],
    ids=["heads", "ffn-width", "kv-heads", "mqa", "alibi", "qk_ln", "qlora", "moe"],
)
def test_what_the_plan_cannot_split_is_refused_naming_the_key(keys, degree, named):
    config = MPTCausalLM.checked_config({**MPT, **keys})
    with pytest.raises(ConfigError, match=f"parallelism.tensor_parallel_degree' is {degree}.*{named}"):
        check_tensor_parallel(config, degree)


def test_degree_one_accepts_any_model():
    check_tensor_parallel(
        MPTCausalLM.checked_config({**MPT, "attn_config": {"alibi": True}, "learned_pos_emb": False}), 1
    )
