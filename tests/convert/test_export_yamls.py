"""Every model a shipped YAML trains, every MPT of LLM Foundry's YAMLs, and an MPT for each way of exporting
(a built-in class, or foundry's own modeling code for settings none computes) publishes to Hugging Face.

Each model, shrunk to a tiny size, trains 2 batches; ``foundry convert to-hf`` exports the checkpoint;
one subprocess that imports only transformers and torch (tests/convert/hf_reload.py) loads every export and
checks its logits (fp32, within 1e-5 of the largest logit) and its greedy ``generate`` on left-padded
prompts against foundry's; ``foundry convert from-hf`` reads each export back to the same model, bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import token_batches

from foundry.cli import main
from foundry.convert.checkpoint_io import resolve_checkpoint
from foundry.convert.commands import from_hf_model
from foundry.models.build import build_model
from foundry.trainer import Trainer

REPO_ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = Path(os.environ.get("FOUNDRY_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
LLM_FOUNDRY_YAMLS = SHARED_DATA / "reference" / "llm-foundry-yamls"
SHIPPED = [
    *sorted(path.relative_to(REPO_ROOT) for path in (REPO_ROOT / "yamls" / "pretrain").glob("*.yaml")),
    *sorted(path.relative_to(REPO_ROOT) for path in (REPO_ROOT / "yamls" / "finetune").glob("*.yaml")),
    Path("yamls/quickstart.yaml"),
    Path("yamls/quickstart-llama.yaml"),
]
VOCAB = 320  # covers the 300-token test tokenizer
TINY = {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 32, "vocab_size": VOCAB, "init_device": "cpu"}
NEW_TOKENS = 4


def llm_foundry_yamls() -> list[Path]:
    """LLM Foundry's YAMLs whose model is an MPT or a Llama: foundry's MPT (MegaBlocks MoE aside: its GELU experts
    with an output bias are no transformers class) or a Hugging Face MPT or Llama trained as ``hf_causal_lm``."""
    if not LLM_FOUNDRY_YAMLS.is_dir():
        return []
    paths = sorted(LLM_FOUNDRY_YAMLS.glob("*/*.yaml"))
    return [path for path in paths if (_model(path).get("name") == "mpt_causal_lm" and "moe" not in path.name)
            or hf_stand_in(path) is not None]  # fmt: skip


def hf_stand_in(path: Path) -> str | None:
    """'llama' or 'mpt' for an ``hf_causal_lm`` YAML of a Llama or MPT (its tiny local stand-in), else None."""
    model = _model(path)
    if model.get("name") != "hf_causal_lm":
        return None
    source = str(model.get("pretrained_model_name_or_path", ""))
    source = str(yaml.safe_load(path.read_text()).get("variables", {}).get("model_name", source))
    return next((family for family in ("llama", "mpt") if family in source.lower()), None)


def tiny_hf_model(family: str, folder: Path) -> Path:
    """A tiny transformers Llama or MPT saved to ``folder``: what an ``hf_causal_lm`` YAML's Hub model stands for."""
    import transformers

    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32,
        )  # fmt: skip
    else:
        config = transformers.MptConfig(vocab_size=VOCAB, d_model=64, n_heads=4, n_layers=2, max_seq_len=32)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def _model(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()).get("model") or {}


def tiny_section(path: Path) -> dict[str, Any]:
    """The YAML's model section at test size, on SDPA; a LoRA run's base model (its adapters go out merged).
    An ``hf_causal_lm`` names its stand-in (``hf_stand_in``), filled in by the ``exports`` fixture."""
    family = hf_stand_in(path)
    if family is not None:
        return {"name": "hf_causal_lm", "pretrained_model_name_or_path": family, "pretrained": True}
    section = {key: value for key, value in _model(path).items() if key != "peft_config"}
    section.update(TINY)
    if section.get("kv_n_heads"):
        section["kv_n_heads"] = 2
    if section.get("ffn_hidden_size"):
        section["ffn_hidden_size"] = 128
    if "attn_impl" in section:
        section["attn_impl"] = "sdpa"
    if isinstance(section.get("attn_config"), dict):
        section["attn_config"] = {**section["attn_config"], "attn_impl": "sdpa"}
    return section


@torch.no_grad()
def greedy_tokens(model: torch.nn.Module, prompts: torch.Tensor, mask: torch.Tensor, steps: int) -> torch.Tensor:
    """foundry's greedy continuation (no KV cache) of left-padded ``prompts``: (batch, steps)."""
    ids, new = prompts, []
    for _ in range(steps):
        token = model({"input_ids": ids, "attention_mask": mask})[:, -1].argmax(-1, keepdim=True)
        new.append(token)
        ids, mask = torch.cat([ids, token], dim=1), torch.cat([mask, torch.ones_like(token)], dim=1)
    return torch.cat(new, dim=1)


def export(section: dict[str, Any], root: Path, tokenizer_dir: Path) -> dict[str, Any]:
    """Train the tiny model 2 batches, export it; what the reload and the round trip compare against."""
    torch.manual_seed(0)
    model = build_model(section)
    config = {"model": section, "tokenizer": {"name": str(tokenizer_dir)}}
    Trainer(
        model, token_batches(2, 2, seq_len=16, vocab_size=VOCAB), max_duration="2ba", save_folder=str(root / "ckpt"),
        save_interval="2ba", run_folder=str(root / "run"), log_to_console=False, config=config, device="cpu",
    ).fit()  # fmt: skip
    assert main(["convert", "to-hf", str(root / "ckpt"), str(root / "hf")]) == 0
    model.eval()
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (2, 16), generator=generator)
    prompts = torch.randint(0, 300, (2, 6), generator=generator)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[1, :3] = 0  # the second prompt is 3 tokens, left-padded
    pad_token_id = json.loads((root / "hf" / "config.json").read_text())["pad_token_id"]
    prompts[1, :3] = pad_token_id
    mask = torch.ones_like(input_ids)
    mask[0, :5] = 0
    with torch.no_grad():
        logits = model({"input_ids": input_ids})
        padded_logits = model({"input_ids": input_ids, "attention_mask": mask})
    inputs = {"input_ids": input_ids, "logits": logits, "mask": mask, "padded_logits": padded_logits,
              "prompts": prompts, "prompt_mask": prompt_mask, "new_tokens": NEW_TOKENS,
              "pad_token_id": pad_token_id}  # fmt: skip
    torch.save(inputs, root / "inputs.pt")
    expected = greedy_tokens(model, prompts, prompt_mask, NEW_TOKENS)
    eos = json.loads((root / "hf" / "config.json").read_text())["eos_token_id"]
    return {"dir": root / "hf", "ckpt": root / "ckpt", "model": model, "section": section, "greedy": expected,
            "eos": eos, "inputs": root / "inputs.pt"}  # fmt: skip


def yaml_class(path: Path) -> str:
    """The class a YAML's model exports as: docs/HF_INTEROP.md's table, by example."""
    if hf_stand_in(path) is not None:
        return {"llama": "LlamaForCausalLM", "mpt": "MptForCausalLM"}[hf_stand_in(path)]
    if path.name.startswith(("llama", "quickstart-llama")):
        return "LlamaForCausalLM"
    if path.name.startswith("moe"):
        return "OlmoeForCausalLM"  # OLMoE's shape
    if path.name.startswith("qwen3"):
        return "Qwen3MoeForCausalLM"
    return "MptForCausalLM" if path.name.startswith("quickstart") else "GPT2LMHeadModel"


# One tiny MPT per way of exporting, beyond the YAMLs' models: (model keys, the class it exports as).
FOUNDRY_CODE = "FoundryMPTForCausalLM"
SETTINGS: dict[str, tuple[dict[str, Any], str]] = {
    "gqa-qk_ln-clip-logit_scale": (
        {"attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 2, "qk_ln": True, "clip_qkv": 2.0},
         "logit_scale": 0.5}, FOUNDRY_CODE),
    "mqa-alibi-window-qk_gn": (
        {"learned_pos_emb": False, "attn_config": {"attn_type": "multiquery_attention", "alibi": True,
                                                   "sliding_window_size": 4, "qk_gn": True}}, FOUNDRY_CODE),
    "rope_dail-gelu_glu-rmsnorm-untied": (
        {"learned_pos_emb": False, "attn_config": {"rope": True}, "ffn_config": {"ffn_type": "mptglu"},
         "norm_type": "rmsnorm", "tie_word_embeddings": False}, FOUNDRY_CODE),
    "no_positions-biases": ({"learned_pos_emb": False}, FOUNDRY_CODE),
    "alibi-biases": ({"learned_pos_emb": False, "attn_config": {"alibi": True}}, FOUNDRY_CODE),
    "rope_hf-layernorm-softmax_scale": (
        {"learned_pos_emb": False, "attn_config": {"rope": True, "rope_impl": "hf", "softmax_scale": 0.2}},
        FOUNDRY_CODE),
    "alibi-no_bias-inv_sqrt_logit_scale": (
        {"learned_pos_emb": False, "no_bias": True, "attn_config": {"alibi": True}, "logit_scale": "inv_sqrt_d_model"},
        FOUNDRY_CODE),
    "llama_in_mpt_keys-llama3_scaling": (
        {"learned_pos_emb": False, "no_bias": True, "norm_type": "rmsnorm",
         "attn_config": {"rope": True, "rope_impl": "hf", "attn_type": "grouped_query_attention", "kv_n_heads": 2,
                         "rope_hf_config": {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}},
         "ffn_config": {"ffn_type": "mptglu", "ffn_act_fn": {"name": "silu"}}}, "LlamaForCausalLM"),
    "learned_pos-no_bias-untied-gelu_tanh": (
        {"no_bias": True, "tie_word_embeddings": False,
         "ffn_config": {"ffn_act_fn": {"name": "gelu", "approximate": "tanh"}}}, "GPT2LMHeadModel"),
}  # fmt: skip
CASES: dict[str, tuple[dict[str, Any], str]] = {
    **{str(path): (tiny_section(REPO_ROOT / path), yaml_class(path)) for path in SHIPPED},
    **{f"llm-foundry/{path.relative_to(LLM_FOUNDRY_YAMLS)}": (tiny_section(path), yaml_class(path))
       for path in llm_foundry_yamls()},
    **{f"mpt/{name}": ({"name": "mpt_causal_lm", **TINY, **keys}, hf_class)
       for name, (keys, hf_class) in SETTINGS.items()},
}  # fmt: skip
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="session")  # not rebuilt when a shuffled order leaves this module and comes back
def exports(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, dict[str, Any]]:
    """Each case's export; YAMLs whose tiny models are the same model (mpt-125m ... mpt-7b) share one."""
    by_model: dict[str, dict[str, Any]] = {}
    cases = {}
    stand_ins = {family: tiny_hf_model(family, tmp_path_factory.mktemp(family)) for family in ("llama", "mpt")}
    for name, (section, _) in CASES.items():
        if section["name"] == "hf_causal_lm":
            section = {
                **section,
                "pretrained_model_name_or_path": str(stand_ins[section["pretrained_model_name_or_path"]]),
            }
        key = json.dumps(build_model({**section, "init_device": "meta"}).model_section(), sort_keys=True)
        if key not in by_model:
            by_model[key] = export(section, tmp_path_factory.mktemp("export"), tokenizer_dir)
        cases[name] = by_model[key]
    return cases


@pytest.fixture(scope="session")
def reloaded(exports: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """What transformers, in a Python that never imported foundry, makes of every export."""
    folder = tmp_path_factory.mktemp("reload")
    manifest = {
        str(entry["dir"]): {"dir": str(entry["dir"]), "inputs": str(entry["inputs"]),
                            "trust_remote_code": "auto_map" in json.loads((entry["dir"] / "config.json").read_text())}
        for entry in exports.values()
    }  # fmt: skip
    (folder / "manifest.json").write_text(json.dumps(manifest))
    script = Path(__file__).with_name("hf_reload.py")
    args = [sys.executable, str(script), str(folder / "manifest.json"), str(folder / "results.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((folder / "results.json").read_text())


def test_the_reloading_process_never_imported_foundry(reloaded) -> None:
    assert reloaded["_imported_foundry"] is False


@pytest.mark.parametrize("name", CASES)
def test_export_loads_in_transformers_alone_with_foundrys_logits_and_generation(name, exports, reloaded) -> None:
    entry = exports[name]
    result = reloaded[str(entry["dir"])]
    assert result["class"] == CASES[name][1]
    assert result["relative_gap"] <= 1e-5
    assert result["padded_relative_gap"] <= 1e-5
    for row, tokens in enumerate(result["new_tokens"]):  # up to the end of sequence, where generate stops a row
        length = tokens.index(entry["eos"]) + 1 if entry["eos"] in tokens else NEW_TOKENS
        assert tokens[:length] == entry["greedy"][row, :length].tolist()


@pytest.mark.parametrize("name", [name for name, (section, _) in CASES.items() if section["name"] != "hf_causal_lm"])
def test_from_hf_gives_back_the_same_model_bit_for_bit(name, exports) -> None:
    entry = exports[name]
    model, section = from_hf_model(entry["dir"])
    _, config = resolve_checkpoint(entry["ckpt"])
    assert section == config["model"]
    original = entry["model"].state_dict()
    imported = model.state_dict()
    assert imported.keys() == original.keys()
    assert all(torch.equal(imported[name], original[name]) for name in original)


def test_llm_foundry_mpt_and_llama_yamls_are_among_the_cases(shared_data) -> None:
    """Skipped, visibly, where the shared data (and so LLM Foundry's YAMLs) is absent; else they are all exported."""
    assert {path.name for path in llm_foundry_yamls()} >= {"mpt-7b.yaml", "testing.yaml", "hf-llama-3.1-8B.yaml"}
    assert all(f"llm-foundry/{path.relative_to(LLM_FOUNDRY_YAMLS)}" in CASES for path in llm_foundry_yamls())
