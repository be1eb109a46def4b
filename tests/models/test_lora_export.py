"""LoRA checkpoints and their way out: adapters-only saves, resuming, PEFT-format export (loaded by peft), merge."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA, TINY_MPT, token_batches

from foundry.convert.checkpoint_io import (
    check_weights_loaded,
    load_checkpoint_model,
    save_weights_checkpoint,
    unloaded_model,
)
from foundry.convert.hf_export import to_hf_model
from foundry.errors import CheckpointError
from foundry.models.build import build_model
from foundry.models.lora import adapter_state_dict, is_adapter_key, merged_state_dict
from foundry.models.lora_checkpoint import holds_adapters_only, saved_model_keys
from foundry.optim import DecoupledAdamW
from foundry.peft.export import (
    add_export_adapter_arguments,
    add_merge_arguments,
    load_lora_checkpoint,
    run_export_adapter,
    run_merge,
    write_peft_adapter,
)
from foundry.trainer import Trainer

peft = pytest.importorskip("peft")

PEFT_CONFIG: dict[str, Any] = {"r": 4, "lora_alpha": 8, "target_modules": ["Wqkv", "out_proj", "up_proj", "down_proj"]}
LLAMA: dict[str, Any] = {"name": "llama_causal_lm", **TINY_LLAMA}
HF_MPT: dict[str, Any] = {
    "name": "mpt_causal_lm", **TINY_MPT, "no_bias": True, "learned_pos_emb": False, "attn_config": {"alibi": True},
}  # fmt: skip
VOCAB = TINY_LLAMA["vocab_size"]


def command(add_arguments, run, *argv: Any) -> int:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return run(parser.parse_args([str(arg) for arg in argv]))


def train_lora(root: Path, base: Path, num_batches: int, save_adapters_only: bool, **trainer_kwargs: Any) -> Trainer:
    """A LoRA run on ``base``'s weights; lr high enough that the adapters move far from zero."""
    section = {**LLAMA, "peft_config": {**PEFT_CONFIG, "save_adapters_only": save_adapters_only}}
    config = {"model": section, "load_path": str(base)}
    torch.manual_seed(3)
    trainer = Trainer(
        build_model(section), token_batches(num_batches, 2, seq_len=16, vocab_size=VOCAB), device="cpu",
        max_duration=f"{num_batches}ba", optimizers=lambda params: DecoupledAdamW(params, lr=3e-2),
        save_folder=str(root / "ckpt"), save_interval="1ba", run_folder=str(root / "run"), log_to_console=False,
        load_path=str(base), load_weights_only=True, config=config, **trainer_kwargs,
    )  # fmt: skip
    trainer.fit()
    return trainer


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("base")
    save_weights_checkpoint(build_model(LLAMA), root, {"model": LLAMA}, overwrite=False)
    return root


@pytest.fixture(scope="module")
def adapters_run(tmp_path_factory: pytest.TempPathFactory, base_checkpoint: Path) -> tuple[Path, torch.nn.Module]:
    """(save_folder of a 2-batch adapters-only LoRA run on the base checkpoint, its final model)."""
    trainer = train_lora(tmp_path_factory.mktemp("lora"), base_checkpoint, 2, save_adapters_only=True)
    return Path(trainer.save_folder), trainer.state.model.eval()


@pytest.fixture
def input_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


def logits(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model({"input_ids": input_ids})


def test_adapters_only_checkpoint_holds_the_adapter_tensors_alone(adapters_run):
    folder, model = adapters_run
    assert holds_adapters_only(folder / "ep0-ba2")
    assert saved_model_keys(folder / "ep0-ba2") == set(adapter_state_dict(model))


def test_adapters_only_checkpoint_loads_onto_its_base(adapters_run, input_ids):
    folder, model = adapters_run
    loaded = load_lora_checkpoint(folder, {**LLAMA, "peft_config": PEFT_CONFIG}).eval()
    torch.testing.assert_close(logits(loaded, input_ids), logits(model, input_ids), atol=0, rtol=0)


def test_adapters_only_run_resumes_exactly(tmp_path, base_checkpoint):
    straight = train_lora(tmp_path / "straight", base_checkpoint, 3, save_adapters_only=True)
    train_lora(tmp_path / "resumed", base_checkpoint, 2, save_adapters_only=True)
    resumed = train_lora(tmp_path / "resumed", base_checkpoint, 3, save_adapters_only=True, autoresume=True)
    assert resumed.state.timestamp.batch == 3
    for name, tensor in straight.state.model.state_dict().items():
        torch.testing.assert_close(resumed.state.model.state_dict()[name], tensor, atol=0, rtol=0, msg=name)


def test_exported_llama_adapter_gives_foundry_logits_in_peft(adapters_run, base_checkpoint, tmp_path, input_ids):
    folder, model = adapters_run
    assert command(add_export_adapter_arguments, run_export_adapter, folder, tmp_path / "adapter") == 0
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["target_modules"] == ["down_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    hf_base = to_hf_model(load_checkpoint_model(base_checkpoint, LLAMA), "llama_causal_lm")
    peft_model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=input_ids).logits
    torch.testing.assert_close(theirs, logits(model, input_ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "section", [HF_MPT, {"name": "mpt_causal_lm", **TINY_MPT}], ids=["MptForCausalLM", "GPT2LMHeadModel"]
)
def test_exported_mpt_adapter_gives_foundry_logits_in_peft(tmp_path, input_ids, section):
    torch.manual_seed(0)
    base = build_model(section).eval()
    lora = build_model({**section, "peft_config": PEFT_CONFIG}).eval()
    lora.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        for tensor in adapter_state_dict(lora).values():
            tensor.normal_(std=0.1)
    write_peft_adapter(lora, "mpt_causal_lm", tmp_path / "adapter", base_model_name_or_path="")
    peft_model = peft.PeftModel.from_pretrained(to_hf_model(base, "mpt_causal_lm"), tmp_path / "adapter").eval()
    with torch.no_grad():
        theirs = peft_model(input_ids=input_ids).logits
    torch.testing.assert_close(theirs, logits(lora, input_ids), atol=1e-5, rtol=0)


def test_merge_command_writes_weights_that_give_the_lora_logits(adapters_run, tmp_path, input_ids):
    folder, model = adapters_run
    assert command(add_merge_arguments, run_merge, folder, tmp_path / "merged", "--dtype", "fp32") == 0
    merged = load_checkpoint_model(tmp_path / "merged", LLAMA).eval()
    assert not any(is_adapter_key(name) for name in merged.state_dict())
    torch.testing.assert_close(logits(merged, input_ids), logits(model, input_ids), atol=1e-5, rtol=0)


def test_merge_command_rounds_the_fp32_sums_to_bf16_once_by_default(adapters_run, tmp_path):
    folder, model = adapters_run
    assert command(add_merge_arguments, run_merge, folder, tmp_path / "merged") == 0
    merged = load_checkpoint_model(tmp_path / "merged", LLAMA)
    for name, tensor in merged_state_dict(model).items():
        torch.testing.assert_close(merged.state_dict()[name], tensor.bfloat16().float(), atol=0, rtol=0, msg=name)


def test_adapters_only_checkpoint_loads_its_base_wherever_a_model_is_read(adapters_run, input_ids):
    # foundry eval --model and foundry.load_model read checkpoints through load_checkpoint_model.
    folder, model = adapters_run
    loaded = load_checkpoint_model(folder / "ep0-ba2", {**LLAMA, "peft_config": PEFT_CONFIG}).eval()
    torch.testing.assert_close(logits(loaded, input_ids), logits(model, input_ids), atol=0, rtol=0)


def test_adapters_only_checkpoint_whose_base_is_gone_is_refused_naming_adapters(adapters_run, tmp_path):
    folder = tmp_path / "ep0-ba2"
    shutil.copytree(adapters_run[0] / "ep0-ba2", folder)
    meta = json.loads((folder / "meta.json").read_text())
    meta["config"]["load_path"] = str(tmp_path / "deleted-base")
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="--adapters"):
        load_checkpoint_model(folder, {**LLAMA, "peft_config": PEFT_CONFIG})


def test_a_model_whose_weights_were_never_loaded_is_refused(adapters_run):
    section = {**LLAMA, "peft_config": PEFT_CONFIG}
    adapters_alone = load_checkpoint_model(adapters_run[0] / "ep0-ba2", section, with_base=False)
    with pytest.raises(CheckpointError, match="unloaded.*--adapters"):
        check_weights_loaded(adapters_alone, "this model")
    check_weights_loaded(unloaded_model(section), "", ignore=lambda name: True)  # nothing left to check: fine
