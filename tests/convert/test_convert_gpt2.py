"""A GPT-2 from the Hub imports as foundry's MPT (learned positions, biases) with GPT-2's logits."""

from __future__ import annotations

import pytest
import torch

from foundry.convert.commands import from_hf_model
from foundry.errors import ConfigError


def tiny_gpt2(**overrides):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=64, n_layer=2, n_head=4, **overrides)
    return GPT2LMHeadModel(config).eval()


@torch.no_grad()
def test_a_hub_gpt2_imports_with_its_logits(tmp_path, input_ids) -> None:
    hf_model = tiny_gpt2()  # activation_function gelu_new: GELU's tanh form
    hf_model.save_pretrained(tmp_path / "gpt2")
    model, section = from_hf_model(tmp_path / "gpt2")
    assert section["learned_pos_emb"] and not section["no_bias"]
    assert section["ffn_config"]["ffn_act_fn"] == {"name": "gelu", "approximate": "tanh"}
    ours, theirs = model.eval()({"input_ids": input_ids}), hf_model(input_ids=input_ids).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_a_gpt2_with_attention_scaled_by_layer_is_refused_naming_the_key(tmp_path) -> None:
    tiny_gpt2(scale_attn_by_inverse_layer_idx=True).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ConfigError, match="scale_attn_by_inverse_layer_idx.*hf_causal_lm"):
        from_hf_model(tmp_path / "gpt2")
