"""``foundry eval --model BASE --adapters A B``: each adapter scores as its own checkpoint does, on one base."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA

from foundry.convert.checkpoint_io import save_weights_checkpoint
from foundry.data import builtin_corpus_documents, train_bpe_tokenizer
from foundry.eval.adapters import evaluate_adapters
from foundry.eval.task_config import parse_icl_tasks
from foundry.eval_command import EvalConfig, evaluate_source
from foundry.models.build import build_model
from foundry.models.lora import adapter_state_dict

LLAMA = {"name": "llama_causal_lm", **TINY_LLAMA, "vocab_size": 320}
PEFT_CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["Wqkv", "out_proj"]}
ROWS = [
    {"query": "Pick:", "choices": ["the", "of", "and"], "gold": 0},
    {"query": "Again:", "choices": ["is", "to", "in"], "gold": 1},
    {"query": "Last:", "choices": ["it", "be", "as"], "gold": 2},
]


def write_adapters(tmp_path: Path, section: dict[str, Any], base: torch.nn.Module, config: dict[str, Any]) -> list[str]:
    """Two LoRA checkpoints of ``section`` on ``base``'s weights with random adapters; their paths."""
    paths = []
    for seed in (1, 2):
        lora = build_model(section)
        lora.load_state_dict(base.state_dict(), strict=False)
        with torch.no_grad():
            for tensor in adapter_state_dict(lora).values():
                tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed)))
        save_weights_checkpoint(lora, tmp_path / f"adapter{seed}", {"model": section, **config}, overwrite=False)
        paths.append(str(tmp_path / f"adapter{seed}"))
    return paths


def assert_each_adapter_scores_as_its_own_checkpoint(tmp_path: Path, base: str, adapters: list[str], capsys) -> None:
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    tasks = parse_icl_tasks(
        [{"label": "mc", "dataset_uri": str(tmp_path / "mc.jsonl"), "icl_task_type": "multiple_choice"}]
    )
    cfg = EvalConfig(icl_seq_len=32, precision="fp32", progress_bar=False)
    device = torch.device("cpu")
    switched = evaluate_adapters([base], adapters, tasks, None, cfg, device)
    assert [result.name for result in switched] == adapters
    for result, path in zip(switched, adapters):
        assert result.results == evaluate_source(path, tasks, None, cfg, device).results
    assert "adapter switch median" in capsys.readouterr().out


@pytest.fixture
def tokenizer(tmp_path: Path) -> dict[str, str]:
    train_bpe_tokenizer(builtin_corpus_documents()[:2], vocab_size=300, out_dir=tmp_path / "tok")
    return {"name": str(tmp_path / "tok")}


def test_each_adapter_scores_as_its_own_checkpoint(tmp_path: Path, tokenizer, capsys) -> None:
    torch.manual_seed(0)
    base = build_model(LLAMA)
    save_weights_checkpoint(base, tmp_path / "base", {"model": LLAMA, "tokenizer": tokenizer}, overwrite=False)
    config = {"tokenizer": tokenizer, "load_path": str(tmp_path / "base")}
    adapters = write_adapters(tmp_path, {**LLAMA, "peft_config": PEFT_CONFIG}, base, config)
    assert_each_adapter_scores_as_its_own_checkpoint(tmp_path, str(tmp_path / "base"), adapters, capsys)


def test_adapters_of_an_hf_run_score_on_its_hugging_face_directory(tmp_path: Path, tokenizer, capsys) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf_config = LlamaConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(hf_config).save_pretrained(tmp_path / "hf")
    plain = {"name": "hf_causal_lm", "pretrained_model_name_or_path": str(tmp_path / "hf")}
    section = {**plain, "peft_config": {**PEFT_CONFIG, "target_modules": ["q_proj", "o_proj"]}}
    adapters = write_adapters(tmp_path, section, build_model(plain), {"tokenizer": tokenizer})
    assert_each_adapter_scores_as_its_own_checkpoint(tmp_path, str(tmp_path / "hf"), adapters, capsys)
