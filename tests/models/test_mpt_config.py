"""YAML model sections become an MPTConfig, or fail with the key path and the fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from foundry import registry
from foundry.errors import ConfigError
from foundry.models import MPTConfig
from foundry.schema import parse_dataclass


@pytest.fixture
def parse(mpt_keys: Callable[..., dict[str, Any]]) -> Callable[..., MPTConfig]:
    """Parse a tiny model section with some keys changed, as the YAML loader would."""
    return lambda **keys: parse_dataclass(MPTConfig, mpt_keys(**keys), "model")


def test_defaults_match_llm_foundry() -> None:
    config = MPTConfig()
    assert (config.d_model, config.n_heads, config.n_layers, config.max_seq_len) == (2048, 16, 24, 2048)
    assert config.vocab_size == 50368 and config.tie_word_embeddings and config.learned_pos_emb
    assert config.norm_type == "low_precision_layernorm"
    assert config.init_config.name == "kaiming_normal_" and config.init_config.init_nonlinearity == "relu"
    assert config.init_config.init_div_is_residual is True
    assert config.attn_config.alibi_bias_max == 8 and config.attn_config.rope_theta == 10000


def test_top_level_typo_names_the_key_and_suggests_the_fix(mpt_keys: Callable[..., dict[str, Any]]) -> None:
    keys = mpt_keys()
    keys["n_head"] = keys.pop("n_heads")
    with pytest.raises(ConfigError, match=r"'model\.n_head'.*Did you mean 'n_heads'"):
        parse_dataclass(MPTConfig, keys, "model")


def test_nested_typo_names_the_full_key_path(parse: Callable[..., MPTConfig]) -> None:
    with pytest.raises(ConfigError, match=r"'model\.attn_config\.alibi_bias_mx'.*Did you mean 'alibi_bias_max'"):
        parse(attn_config={"alibi_bias_mx": 4})


def test_wrong_type_names_the_expected_type(parse: Callable[..., MPTConfig]) -> None:
    with pytest.raises(ConfigError, match=r"'model\.d_model' is 'big' \(str\); expected int"):
        parse(d_model="big")


def test_unknown_attn_impl_suggests_the_closest(parse: Callable[..., MPTConfig]) -> None:
    with pytest.raises(ConfigError, match=r"'model\.attn_config\.attn_impl'.*Did you mean 'sdpa'"):
        parse(attn_config={"attn_impl": "sdp"})


def test_unsupported_llm_foundry_value_is_refused_not_ignored(parse: Callable[..., MPTConfig]) -> None:
    with pytest.raises(ConfigError, match=r"prefix_lm.*set it to false"):
        parse(attn_config={"prefix_lm": True})


def test_unknown_loss_fn_is_a_config_error(parse: Callable[..., MPTConfig]) -> None:
    with pytest.raises(ConfigError, match=r"'model\.loss_fn'.*torch_crossentropy"):
        parse(loss_fn="cross_entropy")


def test_fused_crossentropy_is_accepted(parse: Callable[..., MPTConfig]) -> None:
    assert parse(loss_fn="fused_crossentropy").loss_fn == "fused_crossentropy"


def test_grouped_query_attention_needs_kv_n_heads(parse: Callable[..., MPTConfig]) -> None:
    with pytest.raises(ConfigError, match=r"kv_n_heads"):
        parse(attn_config={"attn_type": "grouped_query_attention"})


def test_kv_n_heads_must_divide_n_heads(parse: Callable[..., MPTConfig]) -> None:
    with pytest.raises(ConfigError, match=r"kv_n_heads.*\(3\) must divide 'model\.n_heads' \(4\)"):
        parse(attn_config={"attn_type": "grouped_query_attention", "kv_n_heads": 3})


def test_param_init_fn_is_an_alias_of_init_config_name(parse: Callable[..., MPTConfig]) -> None:
    assert parse(param_init_fn="small_init_").init_config.name == "small_init_"


def test_rope_turns_learned_position_embeddings_off(parse: Callable[..., MPTConfig]) -> None:
    with pytest.warns(UserWarning, match="learned_pos_emb"):
        assert parse(attn_config={"rope": True}).learned_pos_emb is False


def test_logit_scale_accepts_inv_sqrt_d_model(parse: Callable[..., MPTConfig]) -> None:
    assert parse(logit_scale="inv_sqrt_d_model").resolved_logit_scale == pytest.approx(32**-0.5)


def test_registry_builds_from_yaml_keys_and_rejects_typos(mpt_keys: Callable[..., dict[str, Any]]) -> None:
    build = registry.models.get("mpt_causal_lm")
    assert build(**mpt_keys()).config.d_model == 32
    with pytest.raises(ConfigError, match=r"'model\.expansion_rato'.*Did you mean 'expansion_ratio'"):
        build(**mpt_keys(expansion_rato=4))


def test_llamas_attn_impl_spelling_sets_attn_config() -> None:
    section = {"d_model": 32, "n_heads": 4, "n_layers": 2, "attn_impl": "flash"}
    assert parse_dataclass(MPTConfig, section, "model").attn_config.attn_impl == "flash"


def test_both_attn_impl_spellings_must_agree(parse) -> None:
    assert parse(attn_impl="flash", attn_config={"attn_impl": "flash"}).attn_config.attn_impl == "flash"
    with pytest.raises(ConfigError, match=r"'model\.attn_impl' is 'flash' but 'model\.attn_config\.attn_impl' is"):
        parse(attn_impl="flash", attn_config={"attn_impl": "torch"})


def test_loss_fn_auto_fuses_the_loss_only_where_the_kernel_runs_on_a_gpu(monkeypatch) -> None:
    import torch

    from foundry.models import MPTCausalLM
    from foundry.models import mpt as mpt_module
    from foundry.models.base import LossOutput

    model = MPTCausalLM(d_model=32, n_heads=2, n_layers=1, max_seq_len=8, vocab_size=64)
    batch = {"input_ids": torch.randint(0, 64, (2, 8))}
    assert model.config.loss_fn == "auto" and isinstance(model(batch), torch.Tensor)  # on a CPU: logits
    monkeypatch.setattr(mpt_module, "fused_loss_runs_on", lambda device: True)
    assert isinstance(model(batch), LossOutput)
    model.eval()
    assert isinstance(model(batch), torch.Tensor)  # eval forwards always return logits
