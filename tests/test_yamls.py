"""Every shipped YAML loads, validates and builds its model; the pretrain widths give their sizes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from foundry import cli, registry
from foundry.config import load_train_config
from foundry.config.dry_run import GIB, dry_run
from foundry.models.build import build_model

# Train configs: every YAML but yamls/eval/, which holds ICL task lists and gauntlets (tests/eval reads those).
YAMLS = sorted(p for p in (Path(__file__).resolve().parents[1] / "yamls").rglob("*.yaml") if p.parent.name != "eval")
# Parameter counts published for the architectures these widths reproduce (Hugging Face model cards).
PUBLISHED_PARAMS = {  # Llama-3.2-1B, Llama-3-8B (and 3.1, the same widths), OLMoE-1B-7B
    "llama-1b.yaml": 1_235_814_400, "llama-8b.yaml": 8_030_261_248, "llama-8b-64k.yaml": 8_030_261_248,
    "llama-8b-128k.yaml": 8_030_261_248, "llama-8b-256k.yaml": 8_030_261_248, "moe-1b-7b.yaml": 6_919_161_856,
}  # fmt: skip
# Names that round more than 15%: LLM Foundry's MPT-1B has 1.3B parameters.
NOMINAL_PARAMS = {"mpt-1b.yaml": 1.3e9}
MODELS_MD = Path(__file__).resolve().parents[1] / "docs" / "MODELS.md"
# The four-GPU YAMLs and their card's --gpu-memory-gib: each header states the dry run's total a GPU.
FOUR_GPU_YAMLS = {"llama-8b-128k.yaml": 80, "llama-8b-256k.yaml": 141, "qwen3-30b-a3b.yaml": 141}


def model_section_and_model(path: Path) -> tuple[dict, torch.nn.Module]:
    cfg, _ = load_train_config(path, ["model.init_device=meta"])  # meta: no memory, no init time
    if (cfg.model.get("peft_config") or {}).get("quantize_base"):
        pytest.importorskip("torchao", reason="a 4-bit (QLoRA) base needs the optional torchao")
    return cfg.model, build_model(cfg.model)


def num_params(path: Path) -> int:
    return sum(p.numel() for p in model_section_and_model(path)[1].parameters())


@pytest.mark.parametrize("path", YAMLS, ids=[str(path.relative_to(path.parents[1])) for path in YAMLS])
def test_yaml_builds_the_model_its_section_describes(path: Path) -> None:
    section, model = model_section_and_model(path)
    assert isinstance(model, registry.models.get(section["name"]))
    assert len(model.transformer.blocks) == section["n_layers"]
    assert model.transformer.wte.weight.shape == (section["vocab_size"], section["d_model"])


@pytest.mark.parametrize("path", [p for p in YAMLS if p.parent.name == "pretrain"], ids=lambda p: p.name)
def test_pretrain_size_matches_its_name(path: Path) -> None:
    value, unit = re.search(r"(\d+)([mb])(-\d+k|-a\d+b)?\.yaml$", path.name).groups()[:2]  # llama-8b-64k: 8B
    named = int(value) * (1e6 if unit == "m" else 1e9)
    params = num_params(path)
    if path.name in PUBLISHED_PARAMS:
        assert params == PUBLISHED_PARAMS[path.name]
    else:
        nominal = NOMINAL_PARAMS.get(path.name, named)
        assert 0.85 * nominal <= params <= 1.15 * nominal


def test_models_md_states_each_pretrain_size() -> None:
    """docs/MODELS.md's table of pretrain YAMLs gives the counts these YAMLs build."""
    rows = re.findall(r"`([\w.-]+\.yaml)` \|.*\| ([\d,]+) \|", MODELS_MD.read_text())
    pretrain = [path for path in YAMLS if path.parent.name == "pretrain"]
    assert {name: int(count.replace(",", "")) for name, count in rows} == {p.name: num_params(p) for p in pretrain}


@pytest.mark.parametrize("name", FOUR_GPU_YAMLS)
def test_four_gpu_yaml_validates_on_four_ranks_and_its_header_states_its_memory(name: str, capsys) -> None:
    path = MODELS_MD.parents[1] / "yamls" / "pretrain" / name
    assert cli.main(["train", str(path), "--print-config", "--nproc", "4"]) == 0, capsys.readouterr().err
    card_gib = FOUR_GPU_YAMLS[name]
    plan = dry_run(load_train_config(path)[0], world_size=4, device_memory_gib=card_gib)
    stated_gib = float(re.search(r"= ([\d.]+) GiB", path.read_text()).group(1))
    assert plan.total_bytes / GIB == pytest.approx(stated_gib, abs=0.05) and stated_gib < 0.9 * card_gib


@pytest.mark.parametrize(("gpu_memory_gib", "checkpointed"), [(80, "32 of 32"), (139.8, "15 of 32"), (141, "14 of 32")])
def test_llama_8b_checkpoints_every_block_on_80_gb_cards_and_fewer_on_141(gpu_memory_gib, checkpointed, capsys):
    """llama-8b.yaml ships activation_checkpointing: auto; 139.8 GiB is an H200 141GB as torch reports it, where
    the run the YAML's comment cites chose 15."""
    path = MODELS_MD.parents[1] / "yamls" / "pretrain" / "llama-8b.yaml"
    assert load_train_config(path)[0].fsdp_config.activation_checkpointing == "auto"
    arguments = ["--dry-run", "--world-size", "2", "--nproc", "2", "--gpu-memory-gib", str(gpu_memory_gib)]
    assert cli.main(["train", str(path), *arguments]) == 0
    assert f"activation_checkpointing auto: {checkpointed} blocks checkpointed" in capsys.readouterr().out
