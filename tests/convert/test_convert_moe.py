"""foundry's mixtures of experts <-> Mixtral, OLMoE, Qwen3-MoE and DBRX: equal logits, exact round trips."""

from __future__ import annotations

import importlib
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from foundry.checkpoint import latest_checkpoint
from foundry.convert import choose_export, llama_moe
from foundry.convert.commands import from_hf_model
from foundry.convert.hf_export import to_hf_model
from foundry.errors import ConfigError
from foundry.models import LlamaCausalLM, MPTCausalLM
from foundry.models.hf_families import NATIVE_MOE

VOCAB = 96
LLAMA_MOE = {
    "d_model": 32, "n_layers": 2, "n_heads": 4, "kv_n_heads": 2, "vocab_size": VOCAB, "max_seq_len": 32,
    "ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2, "init_std": 0.2,
}  # fmt: skip
# foundry model name, its keys, the transformers class it exports to
FAMILIES: dict[str, tuple[str, dict[str, Any], str]] = {
    "mixtral": ("llama_causal_lm", LLAMA_MOE, "MixtralForCausalLM"),
    "olmoe": ("llama_causal_lm", {**LLAMA_MOE, "qk_norm": "all_heads", "moe_normalize_expert_weights": None}, "Olmoe"),
    "qwen3_moe": ("llama_causal_lm", {**LLAMA_MOE, "qk_norm": "per_head", "norm_eps": 1e-6}, "Qwen3Moe"),
    "dbrx": (
        "mpt_causal_lm",
        {
            "d_model": 32, "n_layers": 2, "n_heads": 4, "vocab_size": VOCAB, "max_seq_len": 32, "no_bias": True,
            "learned_pos_emb": False, "norm_type": "layernorm", "tie_word_embeddings": False,
            "init_config": {"name": "baseline_", "init_std": 0.2},
            "attn_config": {
                "attn_type": "grouped_query_attention", "kv_n_heads": 2, "rope": True, "rope_impl": "hf",
                "clip_qkv": 8.0,
            },
            "ffn_config": {
                "ffn_type": "mb_dmoe", "mlp_type": "glu", "ffn_act_fn": {"name": "silu"}, "ffn_hidden_size": 16,
                "moe_num_experts": 4, "moe_top_k": 2, "moe_normalize_expert_weights": 1.0,
            },
        },
        "DbrxForCausalLM",
    ),
}  # fmt: skip


def foundry_model(family: str, **overrides: Any) -> torch.nn.Module:
    name, keys, _ = FAMILIES[family]
    torch.manual_seed(0)
    model_class = LlamaCausalLM if name == "llama_causal_lm" else MPTCausalLM
    return model_class(**{**keys, "attn_impl": "torch", **overrides}).eval()


@torch.no_grad()
def logit_gap(model: torch.nn.Module, hf_model: torch.nn.Module) -> float:
    input_ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    return (model({"input_ids": input_ids}) - hf_model(input_ids=input_ids).logits).abs().max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_export_computes_the_same_logits_and_imports_back_bit_exact(family: str) -> None:
    model = foundry_model(family)
    name = FAMILIES[family][0]
    hf_model = to_hf_model(model, name)
    assert type(hf_model).__name__.startswith(FAMILIES[family][2])
    assert logit_gap(model, hf_model) < 1e-4
    adapter = choose_export(model, name).adapter
    back = adapter.from_hf_state_dict(hf_model.state_dict(), hf_model.config)
    original = model.state_dict()
    assert back.keys() == original.keys()
    assert all(torch.equal(back[key], original[key]) for key in original)
    section = adapter.from_hf_config(hf_model.config)
    assert section["name"] == NATIVE_MOE[family] == name  # the loaders' table names the model the import builds
    rebuilt = type(model)(**{key: value for key, value in section.items() if key != "name"}, init_device="meta")
    assert rebuilt.config.ffn_config == model.config.ffn_config
    assert rebuilt.config.attn_config.qk_ln == model.config.attn_config.qk_ln


@pytest.mark.parametrize("family", FAMILIES)
def test_a_hugging_face_checkpoint_imports_with_the_same_logits(family: str, tmp_path: Path) -> None:
    hf_model = to_hf_model(foundry_model(family), FAMILIES[family][0])
    torch.manual_seed(3)
    with torch.no_grad():  # fresh weights, drawn by transformers' side of the table
        for parameter in hf_model.parameters():
            parameter.normal_(0.0, 0.2)
    hf_model.save_pretrained(tmp_path)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model, section = from_hf_model(tmp_path)
    assert section["name"] == FAMILIES[family][0]
    assert logit_gap(model.eval(), reloaded) < 1e-4


def test_mixtral_needs_renormalised_weights_and_olmoe_takes_either() -> None:
    raw = foundry_model("mixtral", moe_normalize_expert_weights=None)
    assert importlib.import_module("foundry.convert.mixtral").unmappable_features(raw.config)
    with pytest.raises(ConfigError, match="No Hugging Face class computes this llama_causal_lm"):
        choose_export(raw, "llama_causal_lm")
    olmoe = importlib.import_module("foundry.convert.olmoe")
    assert not olmoe.unmappable_features(foundry_model("olmoe", moe_normalize_expert_weights=1.0).config)


# family -> the training-only MoE settings its Hugging Face config has no field for
UNEXPORTED = {
    "mixtral": ["moe_zloss_weight"],
    "olmoe": ["moe_zloss_weight", "moe_jitter_eps"],
    "qwen3_moe": ["moe_zloss_weight", "moe_jitter_eps"],
    "dbrx": ["moe_zloss_weight"],
}


@pytest.mark.parametrize("family", FAMILIES)
def test_export_keeps_router_jitter_where_the_class_has_it_and_warns_for_what_it_lacks(family: str) -> None:
    adapter = importlib.import_module(f"foundry.convert.{family}")
    model = foundry_model(family)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the defaults (no z-loss, no jitter) export silently
        adapter.to_hf_config(model)
    model.config.ffn_config.moe_zloss_weight, model.config.ffn_config.moe_jitter_eps = 0.001, 0.01
    with pytest.warns(UserWarning, match="training the export under transformers goes without it") as caught:
        hf_config = adapter.to_hf_config(model)
    message = str(caught[0].message)
    assert [key for key in ("moe_zloss_weight", "moe_jitter_eps") if key in message] == UNEXPORTED[family]
    hf_keys = hf_config.to_dict()
    jitter = {
        "mixtral": hf_keys.get("router_jitter_noise"),
        "dbrx": hf_keys.get("ffn_config", {}).get("moe_jitter_eps"),
    }
    assert jitter.get(family) == (None if "moe_jitter_eps" in UNEXPORTED[family] else 0.01)


def test_mixtral_router_jitter_imports_with_a_warning_that_llama_causal_lm_lacks_it() -> None:
    from foundry.convert import mixtral

    hf_config = mixtral.to_hf_config(foundry_model("mixtral"))
    hf_config.router_jitter_noise = 0.01
    with pytest.warns(UserWarning, match="'router_jitter_noise' to 0.01.*trains without it"):
        mixtral.from_hf_config(hf_config)


def test_qwen3_moe_with_dense_layers_is_refused_naming_the_key() -> None:
    from foundry.convert import qwen3_moe

    hf_config = transformers.Qwen3MoeConfig(hidden_size=32, num_attention_heads=4, mlp_only_layers=[0])
    with pytest.raises(ConfigError, match="'mlp_only_layers'.*hf_causal_lm"):
        qwen3_moe.from_hf_config(hf_config)


def test_hf_causal_lm_with_an_moe_warns_and_names_the_conversion(tmp_path: Path) -> None:
    from foundry.models import HFCausalLM

    to_hf_model(foundry_model("mixtral"), "llama_causal_lm").save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=f"foundry convert from-hf {tmp_path} OUT_CKPT.*llama_causal_lm"):
        HFCausalLM(pretrained_model_name_or_path=str(tmp_path), pretrained=False)


def test_load_model_reads_a_hugging_face_moe_as_foundry_moe(tmp_path: Path, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    from foundry.inference import load_model

    hf_model = to_hf_model(foundry_model("olmoe", vocab_size=320), "llama_causal_lm")
    hf_model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path)
    model, tokenizer = load_model(tmp_path)
    assert isinstance(model, LlamaCausalLM) and model.config.ffn_config.moe_num_experts == 4
    assert logit_gap(model, hf_model) < 1e-4
    assert len(tokenizer) == 300


def test_convert_commands_round_trip_a_checkpoint_bit_exact(tmp_path: Path, tokenizer_dir: Path) -> None:
    from foundry.cli import main
    from foundry.convert.checkpoint_io import load_checkpoint_model, save_weights_checkpoint

    model = foundry_model("qwen3_moe", vocab_size=320)
    section = model.model_section()
    save_weights_checkpoint(model, tmp_path / "ckpt", {"model": section}, overwrite=False)
    to_hf = ["convert", "to-hf", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--tokenizer", str(tokenizer_dir)]
    assert main(to_hf) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["Qwen3MoeForCausalLM"]
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    back = load_checkpoint_model(latest_checkpoint(tmp_path / "back"), {**section, "init_device": "meta"})
    original = model.state_dict()
    assert all(torch.equal(back.state_dict()[name], tensor) for name, tensor in original.items())


def mixtral_state_in_layout(monkeypatch: pytest.MonkeyPatch, stacked: bool) -> tuple[Any, dict, Any, Any]:
    """The tiny Mixtral exported as transformers 5 names it (experts stacked) or as transformers 4 does (each expert
    apart), whichever transformers is installed: the adapter, the Hugging Face state and config, the model."""
    monkeypatch.setattr(llama_moe, "STACKED_EXPERTS", stacked)
    model = foundry_model("mixtral")
    adapter = choose_export(model, "llama_causal_lm").adapter
    return adapter, adapter.to_hf_state_dict(model.state_dict(), model), adapter.to_hf_config(model), model


@pytest.mark.parametrize("stacked", [False, True], ids=["per_expert", "stacked"])
def test_both_expert_layouts_import_back_bit_exact(monkeypatch: pytest.MonkeyPatch, stacked: bool) -> None:
    adapter, hf_state, hf_config, model = mixtral_state_in_layout(monkeypatch, stacked)
    assert ("model.layers.0.mlp.experts.gate_up_proj" in hf_state) == stacked
    assert ("model.layers.0.block_sparse_moe.experts.2.w1.weight" in hf_state) == (not stacked)
    back = adapter.from_hf_state_dict(hf_state, hf_config)
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[name], tensor) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize(
    ("stacked", "refusal"),
    [
        (False, r"lack experts \[2\] for 'transformer\.blocks\.0\.ffn\.experts\.gate_proj'"),
        (True, r"hold 3 experts in 'model\.layers\.0\.mlp\.experts\.gate_up_proj'"),
    ],
    ids=["per_expert", "stacked"],
)
def test_an_import_missing_an_expert_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, stacked: bool, refusal: str
) -> None:
    """transformers 4 can lose one expert's matrices; transformers 5's stacked tensor can be an expert short."""
    adapter, hf_state, hf_config, _ = mixtral_state_in_layout(monkeypatch, stacked)
    if stacked:
        name = "model.layers.0.mlp.experts.gate_up_proj"
        hf_state[name] = hf_state[name][[0, 1, 3]]
    else:
        del hf_state["model.layers.0.block_sparse_moe.experts.2.w1.weight"]
    with pytest.raises(ConfigError, match=f"{refusal} \\(num_local_experts is 4 in config.json\\)"):
        adapter.from_hf_state_dict(hf_state, hf_config)


def test_a_folder_holding_both_expert_layouts_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Files of a transformers 4 save beside a transformers 5 one: the two could hold different weights."""
    adapter, hf_state, hf_config, _ = mixtral_state_in_layout(monkeypatch, stacked=False)
    _, stacked_state, _, _ = mixtral_state_in_layout(monkeypatch, stacked=True)
    hf_state["model.layers.0.mlp.experts.down_proj"] = stacked_state["model.layers.0.mlp.experts.down_proj"]
    with pytest.raises(ConfigError, match=r"set 'transformer\.blocks\.0\.ffn\.experts\.down_proj' twice"):
        adapter.from_hf_state_dict(hf_state, hf_config)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_heads_wider_than_d_model_over_n_heads_export_and_import_with_the_same_logits(
    family: str, tmp_path: Path
) -> None:
    """Qwen3-30B-A3B's 32 heads of 128 over d_model 2048: here 4 heads of 16 over 32 (q is 64 wide)."""
    model = foundry_model(family, head_dim=16)
    assert model.transformer.blocks[0].attn.Wqkv.out_features == 4 * 16 + 2 * 2 * 16
    hf_model = to_hf_model(model, "llama_causal_lm")
    assert hf_model.model.layers[0].self_attn.q_proj.weight.shape == (64, 32)
    assert logit_gap(model, hf_model) < 1e-4
    hf_model.save_pretrained(tmp_path)
    imported, section = from_hf_model(tmp_path)
    assert section["head_dim"] == 16
    assert logit_gap(imported.eval(), hf_model) < 1e-4


@pytest.mark.parametrize("family", ["olmoe", "dbrx"])
def test_olmoe_and_dbrx_cannot_take_heads_of_their_own_width(family: str) -> None:
    name, keys, hf_class = FAMILIES[family]
    head_dim = (
        {"head_dim": 16} if name == "llama_causal_lm" else {"attn_config": {**keys["attn_config"], "head_dim": 16}}
    )
    with pytest.raises(
        ConfigError, match=rf"{hf_class}\w* lacks [^;]*attn_config\.head_dim \(must be d_model / n_heads\)"
    ):
        choose_export(foundry_model(family, **head_dim), name)
