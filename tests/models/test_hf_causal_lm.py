"""`model.name: hf_causal_lm`: any local transformers causal LM as a foundry model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import token_batches

from foundry.distributed.placement import init_on_cpu
from foundry.errors import ConfigError
from foundry.models import HFCausalLM, HFCausalLMConfig
from foundry.models.build import build_model
from foundry.schema import parse_dataclass
from foundry.trainer import Trainer

VOCAB = 128


def hf_lm(path: Path, **keys: Any) -> HFCausalLM:
    return build_model({"name": "hf_causal_lm", "pretrained_model_name_or_path": str(path), **keys})


def test_pretrained_model_holds_the_saved_weights(llama_dir) -> None:
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(llama_dir).state_dict()
    loaded = hf_lm(llama_dir).hf_model.state_dict()
    assert all(torch.equal(loaded[name], saved[name]) for name in saved)


def test_pretrained_false_builds_the_architecture_with_fresh_weights(llama_dir) -> None:
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(llama_dir).state_dict()
    torch.manual_seed(1)  # the saved model was initialised from seed 0
    fresh = hf_lm(llama_dir, pretrained=False).hf_model.state_dict()
    assert {name: tensor.shape for name, tensor in fresh.items()} == {name: t.shape for name, t in saved.items()}
    assert not torch.equal(fresh["model.embed_tokens.weight"], saved["model.embed_tokens.weight"])


def test_config_overrides_reach_the_built_model(llama_dir) -> None:
    model = hf_lm(llama_dir, pretrained=False, config_overrides={"num_hidden_layers": 1, "rms_norm_eps": 1e-3})
    assert len(model.hf_model.model.layers) == 1
    assert model.hf_config.rms_norm_eps == 1e-3


def test_nested_config_overrides_update_a_sub_config_key_by_key(tmp_path) -> None:
    from transformers import MptConfig

    config = MptConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=VOCAB, attn_config={"alibi": True})
    config.save_pretrained(tmp_path)
    overrides = {"attn_config": {"clip_qkv": 2.0}}
    model = hf_lm(tmp_path, pretrained=False, config_overrides=overrides, attn_implementation="eager")
    assert model.hf_config.attn_config.clip_qkv == 2.0
    assert model.hf_config.attn_config.alibi is True


def test_unknown_override_key_is_refused_naming_it(llama_dir) -> None:
    with pytest.raises(ConfigError, match=r"'model\.config_overrides\.rms_norm_epz'.*Did you mean 'rms_norm_eps'"):
        hf_lm(llama_dir, pretrained=False, config_overrides={"rms_norm_epz": 1e-3})


def test_checkpoint_with_custom_code_needs_trust_remote_code(tmp_path) -> None:
    auto_map = {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModelForCausalLM": "modeling_tiny.TinyLM"}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tiny_custom", "auto_map": auto_map}))
    with pytest.raises(ConfigError, match=r"'model\.trust_remote_code: true'"):
        hf_lm(tmp_path)


def test_missing_directory_is_refused_naming_the_path(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"pretrained_model_name_or_path.*no_such_model.*not a directory"):
        hf_lm(tmp_path / "no_such_model")


def test_model_without_a_causal_lm_class_is_refused(tmp_path) -> None:
    from transformers import T5Config

    T5Config(d_model=32, num_layers=1, num_heads=2, vocab_size=VOCAB).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="T5Config.*AutoModelForCausalLM"):
        hf_lm(tmp_path, pretrained=False)


def test_pretrained_lora_id_or_path_is_refused_naming_the_key() -> None:
    keys = {"pretrained_model_name_or_path": "x", "pretrained_lora_id_or_path": "some/adapter"}
    with pytest.raises(ConfigError, match=r"'model\.pretrained_lora_id_or_path'.*remove"):
        parse_dataclass(HFCausalLMConfig, keys, "model")


def test_use_flash_attention_2_means_attn_implementation_flash_attention_2(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else None)
    keys = {"pretrained_model_name_or_path": "x", "use_flash_attention_2": True}
    assert parse_dataclass(HFCausalLMConfig, keys, "model").attn_implementation == "flash_attention_2"


def test_use_flash_attention_2_without_flash_attn_warns_and_keeps_the_default(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    keys = {"pretrained_model_name_or_path": "x", "use_flash_attention_2": True}
    with pytest.warns(UserWarning, match="flash_attn package is not installed"):
        assert parse_dataclass(HFCausalLMConfig, keys, "model").attn_implementation is None


@pytest.mark.parametrize("pretrained", [True, False])
@pytest.mark.parametrize("hub_key", ["use_auth_token", "token"])
def test_hub_tokens_do_nothing_with_a_local_directory(llama_dir, pretrained, hub_key) -> None:
    model = hf_lm(llama_dir, pretrained=pretrained, **{hub_key: True})  # LLM Foundry's gated-model YAMLs set it
    assert model.vocab_size == VOCAB


def test_llm_foundrys_mpt_keys_in_config_overrides_reach_a_llama(llama_dir, monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    overrides = {"max_seq_len": 48, "attn_config": {"attn_impl": "flash", "attn_uses_sequence_id": False}}
    with pytest.warns(UserWarning, match="flash_attn"):  # attn_impl: flash asks for flash attention
        model = hf_lm(llama_dir, config_overrides=overrides)
    assert model.hf_config.max_position_embeddings == 48


def test_a_model_built_on_the_meta_device_gets_transformers_init(llama_dir) -> None:
    model = hf_lm(llama_dir, pretrained=False, init_device="meta")
    init_on_cpu(model)
    weights = model.hf_model.model.layers[0].self_attn.q_proj.weight
    assert weights.device.type == "cpu" and torch.isfinite(weights).all() and 0 < weights.std() < 0.1


def test_foundry_loss_equals_transformers_own_loss(llama_dir) -> None:
    model = hf_lm(llama_dir).eval()
    batch = token_batches(1, 2, seq_len=16, vocab_size=VOCAB)[0]
    with torch.no_grad():
        ours = model.loss(model(batch), batch)
        theirs = model.hf_model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
    assert torch.allclose(ours, theirs, atol=1e-6)


def test_trains_two_steps_with_the_foundry_trainer(llama_dir, tmp_path) -> None:
    trainer = Trainer(
        hf_lm(llama_dir), token_batches(2, 2, seq_len=16, vocab_size=VOCAB), max_duration="2ba",
        run_folder=str(tmp_path / "run"), log_to_console=False, device="cpu",
    )  # fmt: skip
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [record["loss/train/total"] for record in records if "loss/train/total" in record]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def test_flops_per_batch_follow_llm_foundrys_formula(llama_dir) -> None:
    model = hf_lm(llama_dir, pretrained=False)
    # Per layer: q 32*32 + k 32*16 + v 32*16 + o 32*32 = 3072, SwiGLU 3*32*64 = 6144, two norms 64 -> 9280.
    # 2 layers + final norm 32 + untied head 128*32; the input embedding (a lookup) is not counted.
    active_params = 2 * 9280 + 32 + VOCAB * 32
    assert model.n_active_params == active_params
    batch_size, seq_len = 2, 16
    expected = 3 * batch_size * (2 * active_params * seq_len + 2 * 2 * 2 * 32 * seq_len**2)
    assert model.flops_per_batch({"input_ids": torch.zeros(batch_size, seq_len, dtype=torch.long)}) == expected


def test_flops_count_attention_over_the_width_of_q_where_head_dim_sets_it(llama_dir) -> None:
    """Heads × head_dim wider than the hidden size (Qwen3's): attention is counted over q, as llama_causal_lm does."""
    model = hf_lm(llama_dir, pretrained=False, config_overrides={"head_dim": 16})
    q_dim = model.hf_config.num_attention_heads * 16
    assert q_dim != model.hf_config.hidden_size
    batch_size, seq_len = 2, 16
    expected = 3 * batch_size * (2 * model.n_active_params * seq_len + 2 * 2 * 2 * q_dim * seq_len**2)
    assert model.flops_per_batch({"input_ids": torch.zeros(batch_size, seq_len, dtype=torch.long)}) == expected


def test_attention_implementation_the_model_lacks_is_refused_naming_the_fix(tmp_path) -> None:
    from transformers import MptConfig

    MptConfig(d_model=32, n_heads=4, n_layers=1, vocab_size=VOCAB).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"attn_implementation: sdpa.*'eager' always works"):
        hf_lm(tmp_path, pretrained=False, attn_implementation="sdpa")  # transformers' MPT has eager attention only


@pytest.mark.parametrize(("config_name", "expected"), [("MptConfig", "eager"), ("LlamaConfig", "sdpa")])
def test_default_attention_is_sdpa_where_the_model_has_it_else_eager(tmp_path, config_name, expected) -> None:
    import transformers

    keys = {"MptConfig": {"d_model": 32, "n_heads": 4, "n_layers": 1}, "LlamaConfig": {"hidden_size": 32}}
    getattr(transformers, config_name)(vocab_size=VOCAB, **keys[config_name]).save_pretrained(tmp_path)
    model = hf_lm(tmp_path, pretrained=False, config_overrides={"num_hidden_layers": 1} if expected == "sdpa" else {})
    assert model.hf_config._attn_implementation == expected


def test_dbrx_experts_take_fp32_router_weights_beside_bf16_tokens(tmp_path) -> None:
    """Under CUDA autocast DBRX's router weights arrive in fp32 while its tokens are bf16, and transformers'
    ``index_add_`` refused the mix (GPU run, transformers 5); the weights are cast to the tokens' dtype."""
    import transformers as tf

    config = tf.DbrxConfig(
        vocab_size=VOCAB, d_model=16, n_heads=2, n_layers=1, max_seq_len=32,
        attn_config={"kv_n_heads": 1, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 32, "moe_num_experts": 2, "moe_top_k": 1},
    )  # fmt: skip
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "dbrx")
    model = hf_lm(tmp_path / "dbrx", pretrained=False, init_device="cpu")
    experts = next(module for module in model.modules() if type(module).__name__ == "DbrxExperts")
    captured: list[tuple] = []
    handle = experts.register_forward_pre_hook(lambda module, args: captured.append(args), prepend=True)
    model({"input_ids": torch.randint(0, VOCAB, (2, 8))})
    handle.remove()
    tokens, *rest = captured[0]  # fp32 throughout: as CUDA autocast hands the router's weights over
    experts.to(torch.bfloat16)
    out = experts(tokens.to(torch.bfloat16), *rest)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
