"""A meta-device model too large for the host is refused, in one paragraph, before any of it is allocated."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA

from foundry.core.parallel_dims import ParallelDims
from foundry.distributed import host_memory
from foundry.distributed.placement import init_on_cpu
from foundry.errors import ConfigError
from foundry.models.build import build_model

YAMLS = Path(__file__).resolve().parents[2] / "yamls" / "finetune"
LLAMA: dict[str, Any] = {"name": "llama_causal_lm", **TINY_LLAMA, "init_device": "meta"}


def test_model_larger_than_the_host_is_refused_before_any_allocation(monkeypatch):
    model = build_model(LLAMA)
    needed = host_memory.bytes_to_create(model)
    assert needed == 4 * sum(p.numel() for p in model.parameters())  # fp32 weights
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: needed - 1)
    with pytest.raises(ConfigError, match=r"takes 0\.0 GB of host memory .* trains on GPUs: run `foundry train"):
        init_on_cpu(model)
    assert all(p.is_meta for p in model.parameters())
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: needed)
    init_on_cpu(model)
    assert not any(p.is_meta for p in model.parameters())


def test_rank_0_of_a_gpu_run_is_told_to_find_more_host_memory(monkeypatch):
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 0)
    with pytest.raises(ConfigError, match="Rank 0 creates the whole model in host memory"):
        init_on_cpu(build_model(LLAMA), torch.device("cuda", 0))


def test_4_bit_weights_count_their_codes_and_their_bf16_values():
    pytest.importorskip("torchao")
    from foundry.models.nf4 import is_nf4

    section = {**LLAMA, "d_model": 256, "multiple_of": 256, "ffn_dim_multiplier": None}
    model = build_model({**section, "peft_config": {"r": 4, "target_modules": "all-linear", "quantize_base": True}})
    nf4 = [p for p in model.parameters() if is_nf4(p)]
    plain = [p for p in model.parameters() if not is_nf4(p)]
    codes = sum(host_memory.stored_bytes(p) for p in nf4)
    assert codes == pytest.approx(sum(p.numel() for p in nf4) * 4.127 / 8, rel=1e-3)
    expected = codes + 2 * sum(p.numel() for p in nf4) + 4 * sum(p.numel() for p in plain)
    assert nf4 and host_memory.bytes_to_create(model) == expected


@pytest.mark.parametrize(
    ("yaml", "ranks", "whole_gb", "by_module_gb"),
    [("llama-70b-qlora.yaml", 2, 181.4, 48.7), ("llama-405b-qlora.yaml", 4, 1029.5, 234.6)],
)
def test_qlora_yamls_initialised_a_module_at_a_time_fit_a_512_gib_host(yaml, ranks, whole_gb, by_module_gb):
    """Rank 0 holds the largest module whole (the fp32 output head, 4.2 / 8.4 GB) while the host's ranks keep their
    shards, counted here in host memory as with cpu_offload: the whole model would not fit the 405B's host."""
    pytest.importorskip("torchao")
    from foundry.config import load_train_config
    from foundry.distributed.protocol import init_steps_of

    config = load_train_config(YAMLS / yaml, ["model.init_device=meta"])[0]
    model = build_model(config.model)
    modules = [module for module, _ in init_steps_of(model)]
    shard_bytes = sum(host_memory.stored_bytes(p) for p in model.parameters()) // ranks
    by_module = host_memory.bytes_to_init_by_module(modules, shard_bytes, ranks)
    assert host_memory.bytes_to_create(model) / 1e9 == pytest.approx(whole_gb, abs=0.05)
    assert by_module / 1e9 == pytest.approx(by_module_gb, abs=0.05)
    assert by_module < 512 * 2**30  # the 4x H200 host's memory


def test_module_at_a_time_init_too_large_for_the_host_is_one_paragraph(monkeypatch):
    model = build_model(LLAMA)
    modules = list(model.modules())
    largest = max(host_memory.bytes_to_init_module(module) for module in modules)
    assert largest == 4 * max(sum(p.numel() for p in m.parameters(recurse=False)) for m in modules)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: largest - 1)
    with pytest.raises(ConfigError, match=r"one module at a time takes 0\.0 GB .* more hosts \(`--nnodes`\)"):
        host_memory.check_fits_by_module(model, modules, torch.device("cpu"))
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: largest)
    host_memory.check_fits_by_module(model, modules, torch.device("cpu"))


def test_hf_checkpointer_whose_gather_exceeds_rank_0s_host_is_refused_at_fit_start(monkeypatch):
    """A whole-model export of the 405B QLoRA YAML: its bf16 values gathered (820 GB) and copied (815 GB)."""
    pytest.importorskip("torchao")
    from foundry.callbacks.hf_checkpointer import HFCheckpointer
    from foundry.config import load_train_config

    config = load_train_config(YAMLS / "llama-405b-qlora.yaml", ["model.init_device=meta"])[0]
    model = build_model(config.model)
    assert host_memory.bytes_to_gather(model, torch.bfloat16) / 1e9 == pytest.approx(1635.2, abs=0.05)
    monkeypatch.setattr(host_memory, "available_host_bytes", lambda: 512 * 2**30)
    dims = ParallelDims(dp_shard=4)
    state = SimpleNamespace(model=model, world_size=4, is_main_process=True, parallel_dims=dims)
    checkpointer = HFCheckpointer(save_folder="out", save_interval="1dur", precision="bfloat16")
    with pytest.raises(ConfigError, match=r"hf_checkpointer gathers .*1635\.2 GB.*export-adapter CKPT OUT"):
        checkpointer.fit_start(state, logger=None)
    small = SimpleNamespace(model=build_model(LLAMA), world_size=4, is_main_process=True, parallel_dims=dims)
    checkpointer.fit_start(small, None)
