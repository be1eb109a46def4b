"""The Llama family: Llama's config vocabulary, its hidden-size rule, llama3 RoPE scaling, GQA, init."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA

from foundry import registry
from foundry.errors import ConfigError
from foundry.models import LlamaCausalLM, LlamaConfig
from foundry.models.attention import RopeHFConfig
from foundry.models.llama import RopeScalingConfig


def tiny_llama(seed: int = 0, **overrides: Any) -> LlamaCausalLM:
    torch.manual_seed(seed)
    return LlamaCausalLM(**{**TINY_LLAMA, **overrides})


def test_hidden_size_rule_gives_llama_3_8b_width() -> None:
    assert LlamaConfig().hidden_size == 14336


def test_hidden_size_rule_rounds_two_thirds_of_four_d_model_up_to_multiple_of() -> None:
    # int(2 * 4 * 768 / 3) = 2048, already a multiple of 256; 2/3 * 4 * 100 = 266 -> 288 with multiple_of 32.
    assert LlamaConfig(d_model=768, multiple_of=256, ffn_dim_multiplier=None).hidden_size == 2048
    assert LlamaConfig(d_model=100, n_heads=4, kv_n_heads=4, multiple_of=32, ffn_dim_multiplier=None).hidden_size == 288


def test_hidden_size_rule_gives_llama_3_2_1b_width() -> None:
    # int(2 * 4 * 2048 / 3) = 5461; * 1.5 = 8191; rounded up to a multiple of 256: 8192.
    assert LlamaConfig(d_model=2048, multiple_of=256, ffn_dim_multiplier=1.5).hidden_size == 8192


def test_ffn_hidden_size_overrides_the_rule() -> None:
    model = tiny_llama(ffn_hidden_size=80)
    assert model.transformer.blocks[0].ffn.up_proj.out_features == 80


def transformers_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """transformers' own frequencies for ``scaling`` (a HF ``rope_scaling`` dict), on 4.x and 5.x."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shape = {"hidden_size": 4 * head_dim, "num_attention_heads": 4}
    if "rope_parameters" in inspect.signature(HFLlamaConfig.__init__).parameters:  # transformers >= 5
        hf_config = HFLlamaConfig(**shape, rope_parameters={"rope_theta": theta, **scaling})
    else:
        hf_config = HFLlamaConfig(**shape, rope_theta=theta, rope_scaling=scaling)
    inv_freq, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_config, torch.device("cpu"))
    return inv_freq.float()


@pytest.mark.parametrize(
    "scaling",
    [{"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64},
     {"rope_type": "linear", "factor": 4.0}],
    ids=["llama3", "linear"],
)  # fmt: skip
def test_scaled_frequencies_equal_transformers(scaling: dict[str, Any]) -> None:
    ours = RopeScalingConfig(**scaling).to_rope_hf_config().inv_freq(128, 500000.0, torch.device("cpu"))
    torch.testing.assert_close(ours, transformers_inv_freq(128, 500000.0, scaling), rtol=1e-6, atol=0)
    assert not torch.equal(ours, RopeHFConfig().inv_freq(128, 500000.0, torch.device("cpu")))


def test_bad_rope_scaling_names_the_llama_key() -> None:
    with pytest.raises(ConfigError, match=r"'model\.rope_scaling\.high_freq_factor'"):
        LlamaCausalLM(**{**TINY_LLAMA, "rope_scaling": {"low_freq_factor": 4.0, "high_freq_factor": 1.0}})


def test_rope_scaling_changes_the_logits() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 4}
    input_ids = torch.randint(0, 96, (1, 32))
    plain, scaled = tiny_llama(), tiny_llama(rope_scaling=scaling)
    assert not torch.allclose(plain({"input_ids": input_ids}), scaled({"input_ids": input_ids}))


def test_grouped_query_attention_has_kv_n_heads_key_value_heads() -> None:
    attention = tiny_llama().transformer.blocks[0].attn
    head_dim = 64 // 4
    assert attention.Wqkv.out_features == 64 + 2 * 2 * head_dim


def test_kv_n_heads_none_is_multihead_attention() -> None:
    model = tiny_llama(kv_n_heads=None)
    assert model.config.attn_config.attn_type == "multihead_attention"
    assert model.transformer.blocks[0].attn.Wqkv.out_features == 3 * 64


def test_parameter_names_are_mpts_with_fused_wqkv() -> None:
    """The Hugging Face export splits Wqkv by these names and the q, k, v row order."""
    block = {"norm_1.weight", "attn.Wqkv.weight", "attn.out_proj.weight", "norm_2.weight",
             "ffn.gate_proj.weight", "ffn.up_proj.weight", "ffn.down_proj.weight"}  # fmt: skip
    expected = {"transformer.wte.weight", "transformer.norm_f.weight", "lm_head.weight"}
    expected |= {f"transformer.blocks.{layer}.{name}" for layer in range(2) for name in block}
    assert set(dict(tiny_llama().named_parameters())) == expected


def test_no_biases_and_an_untied_head() -> None:
    model = tiny_llama()
    assert not any(name.endswith(".bias") for name, _ in model.named_parameters())
    assert model.lm_head is not None and model.lm_head.weight is not model.transformer.wte.weight


def test_weights_start_at_init_std() -> None:
    model = tiny_llama(d_model=256, n_heads=4, vocab_size=512, init_std=0.02)
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.transformer.blocks[0].ffn.down_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_forward_is_causal() -> None:
    model = tiny_llama()
    input_ids = torch.randint(0, 96, (1, 16))
    changed = input_ids.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 96
    before, after = model({"input_ids": input_ids}), model({"input_ids": changed})
    torch.testing.assert_close(before[0, :10], after[0, :10])
    assert not torch.allclose(before[0, 10:], after[0, 10:])


def test_registry_builds_from_yaml_keys() -> None:
    model = registry.models.get("llama_causal_lm")(**TINY_LLAMA)
    assert isinstance(model, LlamaCausalLM) and model.llama_config.kv_n_heads == 2


def test_typo_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"model\.n_kv_heads.*kv_n_heads"):
        LlamaCausalLM(**{**TINY_LLAMA, "n_kv_heads": 2})


def test_kv_n_heads_must_divide_n_heads() -> None:
    with pytest.raises(ConfigError, match=r"model\.kv_n_heads"):
        LlamaCausalLM(**{**TINY_LLAMA, "kv_n_heads": 3})


def test_mpts_attn_config_spelling_sets_the_llama_keys() -> None:
    model = tiny_llama(attn_config={"attn_impl": "flash", "attn_uses_sequence_id": True})
    assert model.llama_config.attn_impl == "flash" and model.config.attn_config.attn_impl == "flash"
    assert model.config.attn_config.attn_uses_sequence_id


def test_attn_config_keys_that_llama_does_not_have_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"'model\.attn_config\.alibi' is not a Llama key.*mpt_causal_lm"):
        tiny_llama(attn_config={"alibi": True})


def test_both_attn_impl_spellings_must_agree_for_llama() -> None:
    with pytest.raises(ConfigError, match=r"'model\.attn_impl' is 'torch' but 'model\.attn_config\.attn_impl'"):
        tiny_llama(attn_impl="torch", attn_config={"attn_impl": "flash"})
