"""LoRA on `hf_causal_lm`: adapters on the HF model's own layers, adapters-only runs, PEFT export, merge, eval."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import token_batches

from foundry.convert.checkpoint_io import load_checkpoint_model
from foundry.errors import ConfigError
from foundry.models.build import build_model
from foundry.models.lora import adapter_state_dict, is_adapter_key
from foundry.models.lora_checkpoint import holds_adapters_only, saved_model_keys
from foundry.optim import DecoupledAdamW
from foundry.peft.export import (
    add_export_adapter_arguments,
    add_merge_arguments,
    load_lora_checkpoint,
    run_export_adapter,
    run_merge,
)
from foundry.trainer import Trainer

peft = pytest.importorskip("peft")

HF_VOCAB = 128  # the llama_dir fixture's
PEFT_CONFIG: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def hf_section(llama_dir: Path, **peft_keys: Any) -> dict[str, Any]:
    peft_config = {**PEFT_CONFIG, **peft_keys}
    return {"name": "hf_causal_lm", "pretrained_model_name_or_path": str(llama_dir), "peft_config": peft_config}


def logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model({"input_ids": input_ids})


def command(add_arguments, run, *argv: Any) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args([str(arg) for arg in argv]))


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(0, HF_VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def adapters_run(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> tuple[Path, torch.nn.Module]:
    """(save_folder of a 2-batch adapters-only run with no load_path: the base is the HF directory, its model)."""
    root = tmp_path_factory.mktemp("hf-lora")
    section = hf_section(llama_dir, save_adapters_only=True)
    torch.manual_seed(3)
    trainer = Trainer(
        build_model(section), token_batches(2, 2, seq_len=16, vocab_size=HF_VOCAB), device="cpu",
        max_duration="2ba", optimizers=lambda params: DecoupledAdamW(params, lr=3e-2),
        save_folder=str(root / "ckpt"), save_interval="1ba", run_folder=str(root / "run"), log_to_console=False,
        config={"model": section},
    )  # fmt: skip
    trainer.fit()
    return Path(trainer.save_folder), trainer.state.model.eval()


def test_adapters_go_on_the_hf_module_names_and_only_they_train(llama_dir, input_ids):
    torch.manual_seed(0)
    model = build_model(hf_section(llama_dir)).eval()
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    expected = {
        f"hf_model.model.layers.{layer}.self_attn.{proj}.lora_{ab}.weight"
        for layer in (0, 1) for proj in ("q_proj", "v_proj") for ab in "AB"
    }  # fmt: skip
    assert trainable == expected
    base = build_model({"name": "hf_causal_lm", "pretrained_model_name_or_path": str(llama_dir)}).eval()
    torch.testing.assert_close(logits(model, input_ids), logits(base, input_ids), atol=0, rtol=0)


def test_all_linear_adapts_every_hf_linear_but_lm_head(llama_dir):
    model = build_model(hf_section(llama_dir, target_modules="all-linear"))
    adapted = {name.split(".")[-3] for name in adapter_state_dict(model)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_foundry_layer_name_on_an_hf_model_lists_its_names(llama_dir):
    with pytest.raises(ConfigError, match=r"'Wqkv' matches no linear layer.*q_proj"):
        build_model(hf_section(llama_dir, target_modules=["Wqkv"]))


def test_adapters_only_checkpoint_loads_onto_the_pretrained_base(adapters_run, llama_dir, input_ids):
    folder, model = adapters_run
    assert holds_adapters_only(folder / "ep0-ba2")
    assert saved_model_keys(folder / "ep0-ba2") == set(adapter_state_dict(model))
    loaded = load_lora_checkpoint(folder, hf_section(llama_dir, save_adapters_only=True)).eval()
    torch.testing.assert_close(logits(loaded, input_ids), logits(model, input_ids), atol=0, rtol=0)


def test_exported_adapter_gives_foundry_logits_in_peft(adapters_run, llama_dir, tmp_path, input_ids):
    from transformers import AutoModelForCausalLM

    folder, model = adapters_run
    assert any(tensor.abs().sum() > 0 for name, tensor in adapter_state_dict(model).items() if ".lora_B." in name)
    assert command(add_export_adapter_arguments, run_export_adapter, folder, tmp_path / "adapter") == 0
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["target_modules"] == ["q_proj", "v_proj"]
    assert adapter_config["base_model_name_or_path"] == str(llama_dir)
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=input_ids).logits
    torch.testing.assert_close(theirs, logits(model, input_ids), atol=1e-5, rtol=0)


def test_merge_command_writes_weights_that_give_the_lora_logits(adapters_run, llama_dir, tmp_path, input_ids):
    folder, model = adapters_run
    assert command(add_merge_arguments, run_merge, folder, tmp_path / "merged", "--dtype", "fp32") == 0
    plain = {"name": "hf_causal_lm", "pretrained_model_name_or_path": str(llama_dir)}
    merged = load_checkpoint_model(tmp_path / "merged", plain).eval()
    assert not any(is_adapter_key(name) for name in merged.state_dict())
    torch.testing.assert_close(logits(merged, input_ids), logits(model, input_ids), atol=1e-5, rtol=0)


def test_adapters_only_hf_run_needs_no_load_path(llama_dir):
    from foundry.config.build import _check_adapters_only_base

    section = hf_section(llama_dir, save_adapters_only=True)
    _check_adapters_only_base(SimpleNamespace(model=section, load_path=None))  # the HF directory is the base
    with pytest.raises(ConfigError, match="set load_path"):
        _check_adapters_only_base(SimpleNamespace(model={**section, "pretrained": False}, load_path=None))
