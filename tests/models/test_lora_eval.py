"""``foundry eval --model BASE --adapters A B``: each adapter scores as its own checkpoint does, on one base."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import TINY_LLAMA

from foundry.builders import build_model
from foundry.convert.checkpoint_io import save_weights_checkpoint
from foundry.data import builtin_corpus_documents, train_bpe_tokenizer
from foundry.eval.command import EvalConfig, evaluate_source
from foundry.eval.tasks import parse_icl_tasks
from foundry.peft.evaluate import evaluate_adapters
from foundry.peft.lora import adapter_state_dict

LLAMA = {"name": "llama_causal_lm", **TINY_LLAMA, "vocab_size": 320}
PEFT_CONFIG = {"r": 4, "lora_alpha": 8, "target_modules": ["Wqkv", "out_proj"]}
ROWS = [
    {"query": "Pick:", "choices": ["the", "of", "and"], "gold": 0},
    {"query": "Again:", "choices": ["is", "to", "in"], "gold": 1},
    {"query": "Last:", "choices": ["it", "be", "as"], "gold": 2},
]


def test_each_adapter_scores_as_its_own_checkpoint(tmp_path: Path, capsys) -> None:
    train_bpe_tokenizer(builtin_corpus_documents()[:2], vocab_size=300, out_dir=tmp_path / "tok")
    tokenizer = {"name": str(tmp_path / "tok")}
    torch.manual_seed(0)
    base = build_model(LLAMA)
    save_weights_checkpoint(base, tmp_path / "base", {"model": LLAMA, "tokenizer": tokenizer}, overwrite=False)
    section = {**LLAMA, "peft_config": PEFT_CONFIG}
    adapters = []
    for seed in (1, 2):
        lora = build_model(section)
        lora.load_state_dict(base.state_dict(), strict=False)
        with torch.no_grad():
            for tensor in adapter_state_dict(lora).values():
                tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(seed)))
        config = {"model": section, "tokenizer": tokenizer, "load_path": str(tmp_path / "base")}
        save_weights_checkpoint(lora, tmp_path / f"adapter{seed}", config, overwrite=False)
        adapters.append(str(tmp_path / f"adapter{seed}"))
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    tasks = parse_icl_tasks(
        [{"label": "mc", "dataset_uri": str(tmp_path / "mc.jsonl"), "icl_task_type": "multiple_choice"}]
    )
    cfg = EvalConfig(icl_seq_len=32, precision="fp32", progress_bar=False)
    device = torch.device("cpu")
    switched = evaluate_adapters([str(tmp_path / "base")], adapters, tasks, None, cfg, device)
    assert [result.name for result in switched] == adapters
    for result, path in zip(switched, adapters):
        assert result.results == evaluate_source(path, tasks, None, cfg, device).results
    assert "adapter switch median" in capsys.readouterr().out
