"""Each of LLM Foundry's train YAMLs trains 2 batches on a CPU with only its paths changed and its sizes shrunk
(or after the change tests/llm_foundry_compat.py names), or stops at once with its documented refusal."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from llm_foundry_compat import YAMLS, Compat, markdown_table

from foundry.cli import main
from foundry.config import load_train_config
from foundry.config.build import build_trainer
from foundry.distributed import destroy_process_group
from foundry.errors import FoundryError
from foundry.yaml_config import load_yaml, resolve_interpolations

REPO_ROOT = Path(__file__).resolve().parents[1]
VOCAB = 512  # the test tokenizer's size, and every tiny model's vocabulary
SEQ_LEN = 64
# The Hub models the YAMLs name -> the tiny local model of the same architecture that stands in for it.
HF_MODELS = {
    "EleutherAI/gpt-neo-125M": "gpt-neo",
    "gpt2": "gpt2",
    "meta-llama/Meta-Llama-3.1-8B": "llama",
    "meta-llama/Meta-Llama-3-8B": "llama",
    "facebook/opt-2.7b": "opt",
    "databricks/dbrx-instruct": "dbrx",
    "mosaicml/mpt-7b": "mpt",
    "mosaicml/mpt-30b": "mpt",
}


def tiny_hf_configs() -> dict[str, Any]:
    import transformers as tf

    return {
        "gpt-neo": tf.GPTNeoConfig(
            vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
            max_position_embeddings=128, window_size=32,
        ),
        "gpt2": tf.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=128),
        "llama": tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=128,
        ),
        "opt": tf.OPTConfig(
            vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=128, word_embed_proj_dim=32,
        ),
        "mpt": tf.MptConfig(vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=2, max_seq_len=128),
        "dbrx": tf.DbrxConfig(
            # DBRX's own rope_theta and clip_qkv: transformers 5's DbrxAttention reads the first without a default
            # and clamps with the second even when it is None (an error), so both are set.
            vocab_size=VOCAB, d_model=32, n_heads=2, n_layers=2, max_seq_len=128,
            attn_config={"kv_n_heads": 1, "rope_theta": 500000.0, "clip_qkv": 8.0},
            ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 2, "moe_top_k": 1},
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def stand_ins(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the YAMLs' paths point at: MDS text (every split name they use) and its tokenizer, finetuning rows
    (jsonl, Dolly-style columns, MDS), tiny Hugging Face models, and two small ICL tasks."""
    from streaming import MDSWriter
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("stand-ins")
    corpus = root / "corpus.txt"
    corpus.write_text((shared_data / "corpus/tinyshakespeare/input.txt").read_text()[:30_000])
    args = [str(corpus), "--out", str(root / "text"), "--concat-tokens", str(SEQ_LEN), "--vocab-size", str(VOCAB)]
    assert main(["data", "convert", *args, "--eval-fraction", "0.3", "--no-progress"]) == 0
    for alias, split in (("train_small", "train"), ("val_small", "val"), ("validation", "val"), ("test", "val")):
        (root / "text" / alias).symlink_to(split)
    rows = [{"prompt": f"What is {i} plus {i}?", "response": f" It is {2 * i}."} for i in range(24)]
    for folder, columns in (("jsonl", ("prompt", "response")), ("dolly", ("instruction", "output"))):
        for split in ("train", "validation", "test"):
            path = root / folder / f"{split}.jsonl"
            path.parent.mkdir(exist_ok=True)
            path.write_text("".join(json.dumps(dict(zip(columns, row.values()))) + "\n" for row in rows))
    with MDSWriter(out=str(root / "mds" / "train"), columns={"prompt": "str", "response": "str"}) as writer:
        for row in rows:
            writer.write(row)
    for name, config in tiny_hf_configs().items():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / "hf" / name)
    mc = [{"query": f"Is {i} even?", "choices": ["yes", "no"], "gold": i % 2} for i in range(4)]
    (root / "mc.jsonl").write_text("".join(json.dumps(row) + "\n" for row in mc))
    (root / "tasks.yaml").write_text(
        f"icl_tasks:\n- {{label: mc, dataset_uri: {root / 'mc.jsonl'}, icl_task_type: multiple_choice}}\n"
    )
    (root / "gauntlet.yaml").write_text(
        "eval_gauntlet:\n  categories:\n  - name: reasoning\n    benchmarks:\n"
        "    - {name: mc, num_fewshot: 0, random_baseline: 0.5}\n"
    )
    return root


def paths_and_sizes(path: Path, stand_ins: Path) -> list[str]:
    """The overrides a user makes on a CPU: every path to the stand-ins, every size small."""
    raw = load_yaml(path)
    resolved = resolve_interpolations(raw)
    variables = raw.get("variables") or {}
    tokenizer = stand_ins / "text" / "tokenizer"
    overrides = [f"tokenizer.name={tokenizer}", "max_duration=2ba", "eval_interval=2ba", "eval_subset_num_batches=1"]
    overrides += ["global_train_batch_size=4", "device_train_microbatch_size=2", "device_eval_batch_size=2"]
    overrides.append("variables.max_seq_len=64" if "max_seq_len" in variables else "max_seq_len=64")
    if "data_local" in variables:
        overrides.append(f"variables.data_local={stand_ins / 'text'}")
    if resolved.get("load_path"):  # a Composer checkpoint of the user's: the run starts from fresh weights here
        overrides.append("load_path=null")
    model = resolved["model"]
    if model["name"] == "mpt_causal_lm":
        overrides += ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", f"model.vocab_size={VOCAB}"]
    elif model["name"] == "hf_causal_lm":
        hf_dir = stand_ins / "hf" / HF_MODELS[model["pretrained_model_name_or_path"]]
        overrides.append(f"model.pretrained_model_name_or_path={hf_dir}")
    for loader in ("train_loader", "eval_loader"):
        section = resolved.get(loader)
        if section is None:
            continue
        overrides.append(f"{loader}.num_workers=0")
        dataset = section["dataset"]
        if "streams" in dataset:
            for stream in dataset["streams"]:
                overrides.append(f"{loader}.dataset.streams.{stream}.local={stand_ins / 'mds'}")
        elif dataset.get("hf_name") == "json":  # local files in LLM Foundry's form, read by a preprocessing_fn
            overrides.append(f"{loader}.dataset.hf_kwargs.data_dir={stand_ins / 'dolly'}")
            overrides.append(f"{loader}.dataset.preprocessing_fn=helpers:instruction_rows")
        elif "hf_name" in dataset:
            overrides.append(f"{loader}.dataset.hf_name={stand_ins / 'jsonl'}")
    tasks = resolved.get("icl_tasks")
    if isinstance(tasks, str):  # a task list of LLM Foundry's: a small one here
        overrides += [f"icl_tasks={stand_ins / 'tasks.yaml'}", f"eval_gauntlet={stand_ins / 'gauntlet.yaml'}"]
    elif tasks:  # listed inline, each dataset_uri left for the user to fill in
        overrides += [f"icl_tasks.{i}.dataset_uri={stand_ins / 'mc.jsonl'}" for i in range(len(tasks))]
    return overrides


def train(path: Path, overrides: list[str]) -> Any:
    cfg, resolved = load_train_config(path, overrides)
    try:
        trainer = build_trainer(cfg, resolved)
        trainer.fit()
    finally:
        destroy_process_group()  # as `foundry train` does: an fsdp_config joins a process group of one
    return trainer


@pytest.mark.slow
@pytest.mark.parametrize("entry", YAMLS, ids=[entry.yaml for entry in YAMLS])
def test_llm_foundry_yaml(entry: Compat, stand_ins, shared_data, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the YAMLs' relative save folders and run folders land here
    path = shared_data / "reference" / "llm-foundry-yamls" / entry.yaml
    overrides = paths_and_sizes(path, stand_ins)
    if entry.refusal:
        with pytest.raises(FoundryError, match=entry.refusal):
            train(path, overrides)
    if entry.runs:
        trainer = train(path, [*overrides, *entry.changes])
        assert trainer.state.timestamp.batch == 2
        assert trainer.state.loss is not None and math.isfinite(trainer.state.loss.item())


def test_every_llm_foundry_yaml_is_listed(shared_data) -> None:
    folder = shared_data / "reference" / "llm-foundry-yamls"
    found = sorted(str(path.relative_to(folder)) for path in folder.glob("*/*.yaml"))
    assert sorted(entry.yaml for entry in YAMLS) == found


def test_the_docs_table_is_the_list() -> None:
    """docs/LLM_FOUNDRY.md shows what these tests check: `python benchmarks/llm_foundry_table.py` rewrites it."""
    text = (REPO_ROOT / "docs" / "LLM_FOUNDRY.md").read_text()
    table = re.search(r"<!-- table: .*? -->\n(.*?)<!-- end of table -->", text, re.S)
    assert table is not None and table.group(1) == markdown_table()
