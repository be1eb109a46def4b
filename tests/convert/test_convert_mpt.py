"""foundry's MPT <-> transformers' MptForCausalLM: exact weights, equal logits, and the features that do not map."""

from __future__ import annotations

import pytest
import torch

from foundry.convert import mpt as adapter
from foundry.convert.hf_export import to_hf_model
from foundry.errors import ConfigError
from foundry.models import MPTCausalLM

ALIBI_CLIPPED = {"alibi": True, "clip_qkv": 0.5, "softmax_scale": 0.3}


def test_foundry_to_hf_to_foundry_weights_are_bit_identical(make_mpt) -> None:
    model = make_mpt(attn_config=ALIBI_CLIPPED)
    hf_model = to_hf_model(model, "mpt_causal_lm")
    back = adapter.from_hf_state_dict(hf_model.state_dict(), hf_model.config)
    original = model.state_dict()
    assert back.keys() == original.keys()
    assert all(torch.equal(back[name], original[name]) for name in original)


def test_alibi_with_clip_qkv_gives_the_same_logits_in_transformers(make_mpt, input_ids, logit_gap) -> None:
    model = make_mpt(attn_config=ALIBI_CLIPPED)
    assert logit_gap(model, to_hf_model(model, "mpt_causal_lm"), input_ids) < 1e-5


def test_alibi_slopes_of_a_head_count_not_a_power_of_two_match(make_mpt, input_ids, logit_gap) -> None:
    model = make_mpt(d_model=48, n_heads=6)  # transformers interleaves the slopes of the next power of two
    assert logit_gap(model, to_hf_model(model, "mpt_causal_lm"), input_ids) < 1e-5


@torch.no_grad()
def test_right_padded_batch_gives_the_same_logits_on_real_tokens(make_mpt, input_ids) -> None:
    model = make_mpt()
    hf_model = to_hf_model(model, "mpt_causal_lm")
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, 20:] = 0
    ours = model({"input_ids": input_ids, "attention_mask": attention_mask})
    theirs = hf_model(input_ids=input_ids, attention_mask=attention_mask).logits
    real = attention_mask.bool()
    assert (ours[real] - theirs[real]).abs().max().item() < 1e-5


def test_imported_section_builds_the_same_network(make_mpt) -> None:
    model = make_mpt(attn_config=ALIBI_CLIPPED, norm_type="layernorm", norm_eps=1e-6)
    section = adapter.from_hf_config(adapter.to_hf_config(model))
    rebuilt = MPTCausalLM(**{key: value for key, value in section.items() if key != "name"})
    for key in ("d_model", "n_heads", "n_layers", "max_seq_len", "vocab_size", "norm_type", "norm_eps", "no_bias"):
        assert getattr(rebuilt.config, key) == getattr(model.config, key), key
    assert rebuilt.config.attn_config == model.config.attn_config
    assert rebuilt.config.ffn_config == model.config.ffn_config


def test_rope_cannot_be_written_as_mpt_and_the_error_names_it(make_mpt) -> None:
    model = make_mpt(attn_config={"alibi": False, "rope": True})
    with pytest.raises(ConfigError, match=r"model\.attn_config\.rope"):
        adapter.to_hf_config(model)


def test_biases_cannot_be_exported_and_the_error_names_no_bias(make_mpt) -> None:
    with pytest.raises(ConfigError, match=r"model\.no_bias"):
        adapter.to_hf_config(make_mpt(no_bias=False))


def test_hf_config_declaring_a_feature_transformers_ignores_is_refused() -> None:
    from transformers import MptConfig

    hf_config = MptConfig(d_model=64, n_heads=4, n_layers=2, no_bias=False)
    with pytest.raises(ConfigError, match="no_bias: false.*hf_causal_lm"):
        adapter.from_hf_config(hf_config)
