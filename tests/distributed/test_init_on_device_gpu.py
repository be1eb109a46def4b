"""``fsdp_config.init_on_device`` on 2 GPUs: a meta-device LoRA model drawn a module at a time on rank 0's GPU gives
every rank its slice of the weights one GPU's whole-model init draws with the same seed. (A QLoRA base differs:
each rank quantizes its slice on the GPU, which on 2026-11-28's H200 run moved some 4-bit values of an
``out_proj`` from a one-GPU init's.)

Run as a test (skips below 2 GPUs), or directly:
``torchrun --nproc-per-node 2 tests/distributed/test_init_on_device_gpu.py OUT_FILE``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SECTION = {
    "name": "llama_causal_lm",
    "d_model": 256,
    "n_layers": 2,
    "n_heads": 4,
    "kv_n_heads": 2,
    "multiple_of": 256,
    "vocab_size": 512,
    "max_seq_len": 64,
    "tie_word_embeddings": False,
}


def _section() -> dict:
    peft_config = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    return {**SECTION, "peft_config": peft_config, "init_device": "meta"}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_init_on_device_gives_one_gpus_whole_init(tmp_path):
    from helpers import repo_pythonpath

    from foundry.models.build import build_model

    out = tmp_path / "weights.pt"
    env = {**os.environ, "PYTHONPATH": repo_pythonpath()}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__]
    done = subprocess.run([*command, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    placed = torch.load(out)
    model = build_model(_section())
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    model.init_weights()
    whole = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    assert placed.keys() == whole.keys()
    for name, weight in whole.items():
        assert torch.equal(placed[name], weight.to(placed[name].dtype)), name
    cpu_model = build_model({**_section(), "init_device": "cpu"})  # the CPU's generator: other values
    assert not torch.equal(cpu_model.state_dict()["transformer.wte.weight"], whole["transformer.wte.weight"])


def _place(out: Path) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from foundry.distributed import destroy_process_group, get_rank, init_process_group
    from foundry.distributed.config import FSDPConfig
    from foundry.distributed.placement import parallelize
    from foundry.models.build import build_model

    init_process_group()
    device = torch.device("cuda", get_rank())
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = build_model(_section())

    def whole_model() -> None:
        raise AssertionError("rank 0 initialised the whole model at once")

    model.init_weights = whole_model
    parallelize(model, FSDPConfig(sharding_strategy="FULL_SHARD", init_on_device=True), device, "fp32")
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if get_rank() == 0:
        torch.save({name: tensor.detach().cpu() for name, tensor in weights.items()}, out)
    destroy_process_group()


if __name__ == "__main__":
    _place(Path(sys.argv[1]))
