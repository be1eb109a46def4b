"""hf_checkpointer: Hugging Face folders written during training, with LLM Foundry's keys, that transformers loads."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA, TINY_MPT, token_batches

from foundry.callbacks import HFCheckpointer
from foundry.errors import ConfigError
from foundry.models import LlamaCausalLM, MPTCausalLM
from foundry.optim import DecoupledAdamW
from foundry.trainer import Trainer


def train_with(callback: HFCheckpointer, tmp_path, batches: int = 3, model: torch.nn.Module | None = None) -> Any:
    torch.manual_seed(0)
    model = model or LlamaCausalLM(**TINY_LLAMA)
    Trainer(
        model=model,
        train_dataloader=token_batches(batches, 2, vocab_size=TINY_LLAMA["vocab_size"]),
        max_duration=f"{batches}ba",
        optimizers=lambda params: DecoupledAdamW(params, lr=1e-3),
        callbacks=[callback],
        device="cpu",
        precision="fp32",
        run_folder=str(tmp_path / "run"),
        run_name="hf-run",
        log_to_console=False,
    ).fit()
    return model.eval()


def test_folders_at_the_interval_and_at_the_end_load_with_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    callback = HFCheckpointer(save_folder=str(tmp_path / "{run_name}" / "checkpoints"), save_interval="2ba")
    model = train_with(callback, tmp_path)
    folder = tmp_path / "hf-run" / "checkpoints" / "huggingface"
    assert sorted(path.name for path in folder.iterdir()) == ["ba2", "ba3"]  # the interval, then the end
    hf_model = AutoModelForCausalLM.from_pretrained(folder / "ba3").eval()
    input_ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(input_ids).logits, model({"input_ids": input_ids}), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("mpt_keys", "hf_class"),
    [
        ({}, "GPT2LMHeadModel"),  # LLM Foundry's default MPT: learned positions, biases
        ({"attn_config": {"attn_type": "grouped_query_attention", "kv_n_heads": 2}}, "FoundryMPTForCausalLM"),
    ],
)
def test_a_learned_position_mpt_writes_a_folder_transformers_loads_with_the_same_logits(
    tmp_path, mpt_keys, hf_class
) -> None:
    from transformers import AutoModelForCausalLM

    callback = HFCheckpointer(save_folder=str(tmp_path / "ckpt"), save_interval="1dur")
    model = train_with(callback, tmp_path, batches=1, model=MPTCausalLM(**TINY_MPT, **mpt_keys))
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt" / "huggingface" / "ba1", trust_remote_code=True)
    assert type(hf_model).__name__ == hf_class
    input_ids = torch.arange(12).reshape(2, 6)
    with torch.no_grad():
        torch.testing.assert_close(hf_model(input_ids).logits, model({"input_ids": input_ids}), atol=1e-5, rtol=0)


def test_precision_sets_the_dtype_of_the_saved_weights(tmp_path) -> None:
    from safetensors import safe_open

    callback = HFCheckpointer(save_folder=str(tmp_path / "ckpt"), save_interval="1dur", precision="bfloat16")
    train_with(callback, tmp_path, batches=1)
    with safe_open(str(tmp_path / "ckpt" / "huggingface" / "ba1" / "model.safetensors"), "pt") as weights:
        assert {weights.get_tensor(name).dtype for name in weights.keys()}  # noqa: SIM118 (a safetensors handle, not a dict) == {torch.bfloat16}


def test_mlflow_registration_is_refused_naming_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match="mlflow_registered_model_name"):
        HFCheckpointer(save_folder=str(tmp_path), save_interval="1ep", mlflow_registered_model_name="m")
