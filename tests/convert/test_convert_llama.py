"""foundry's Llama <-> transformers' LlamaForCausalLM: exact weights, equal logits, refused features."""

from __future__ import annotations

import pytest
import torch

from foundry.convert import llama as adapter
from foundry.convert.hf_export import to_hf_model
from foundry.errors import ConfigError
from foundry.models import LlamaCausalLM

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}


def test_foundry_to_hf_to_foundry_weights_are_bit_identical(make_llama) -> None:
    model = make_llama(rope_scaling=LLAMA3_SCALING)
    hf_model = to_hf_model(model, "llama_causal_lm")
    back = adapter.from_hf_state_dict(hf_model.state_dict(), hf_model.config)
    original = model.state_dict()
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], original[name]) for name in original)


def test_gqa_with_llama3_rope_scaling_gives_the_same_logits_in_transformers(make_llama, input_ids, logit_gap) -> None:
    model = make_llama(rope_scaling=LLAMA3_SCALING)  # kv_n_heads 2 of 4: grouped-query attention
    hf_model = to_hf_model(model, "llama_causal_lm")
    assert hf_model.config.num_key_value_heads == 2
    assert logit_gap(model, hf_model, input_ids) < 1e-5


def test_tied_multihead_llama_with_linear_rope_scaling_gives_the_same_logits(make_llama, input_ids, logit_gap) -> None:
    model = make_llama(kv_n_heads=None, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
    hf_model = to_hf_model(model, "llama_causal_lm")
    assert hf_model.get_output_embeddings().weight is hf_model.get_input_embeddings().weight
    assert logit_gap(model, hf_model, input_ids) < 1e-5


@pytest.mark.parametrize("rope_scaling", [LLAMA3_SCALING, {"rope_type": "linear", "factor": 2}, None])
def test_imported_section_builds_the_same_network(make_llama, rope_scaling) -> None:
    model = make_llama(rope_scaling=rope_scaling, norm_eps=1e-6, rope_theta=500000.0)
    section = adapter.from_hf_config(adapter.to_hf_config(model))
    rebuilt = LlamaCausalLM(**{key: value for key, value in section.items() if key != "name"})
    assert rebuilt.config == model.config  # the MPT-level config: every layer, width, norm and RoPE setting


def test_heads_of_their_own_width_export_import_and_rebuild(make_llama, input_ids, logit_gap) -> None:
    """Qwen3's heads (128 wide, 32 of them over d_model 2048): here 4 of 32 over d_model 64, q 128 wide."""
    model = make_llama(head_dim=32)
    hf_model = to_hf_model(model, "llama_causal_lm")
    assert (hf_model.config.head_dim, hf_model.model.layers[0].self_attn.q_proj.weight.shape) == (32, (128, 64))
    assert logit_gap(model, hf_model, input_ids) < 1e-5
    back = adapter.from_hf_state_dict(hf_model.state_dict(), hf_model.config)
    assert all(torch.equal(back[name], weight) for name, weight in model.state_dict().items())
    section = adapter.from_hf_config(hf_model.config)
    assert section["head_dim"] == 32
    assert LlamaCausalLM(**{key: value for key, value in section.items() if key != "name"}).config == model.config
    assert adapter.from_hf_config(adapter.to_hf_config(make_llama()))["head_dim"] is None  # d_model / n_heads


def test_a_head_dim_rope_cannot_rotate_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="'model.head_dim' is 15; it must be positive and even"):
        LlamaCausalLM(d_model=64, n_heads=4, kv_n_heads=2, n_layers=1, head_dim=15)
    with pytest.raises(ConfigError, match="must be divisible by 'model.n_heads'.*unless 'model.head_dim'"):
        LlamaCausalLM(d_model=66, n_heads=4, kv_n_heads=2, n_layers=1)
    wide = LlamaCausalLM(d_model=66, n_heads=4, kv_n_heads=2, n_layers=1, head_dim=16, init_device="meta")
    assert wide.config.head_dim == 16 and wide.transformer.blocks[0].attn.out_proj.in_features == 64


def test_checkpoint_with_attention_bias_is_refused_naming_it() -> None:
    from transformers import LlamaConfig

    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=4, attention_bias=True)
    with pytest.raises(ConfigError, match="'attention_bias'.*hf_causal_lm"):
        adapter.from_hf_config(hf_config)


def test_unimplemented_rope_scaling_is_refused_naming_it() -> None:
    from transformers import LlamaConfig

    hf_config = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ConfigError, match="'dynamic'"):
        adapter.from_hf_config(hf_config)


def test_a_checkpoint_missing_a_v_projection_is_refused_naming_it(make_llama) -> None:
    hf_model = to_hf_model(make_llama(), "llama_causal_lm")
    hf_state = dict(hf_model.state_dict())
    del hf_state["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ConfigError, match=r"no model\.layers\.1\.self_attn\.v_proj\.weight.*download it again"):
        adapter.from_hf_state_dict(hf_state, hf_model.config)
