"""A meta-device model too large for the host is refused, in one paragraph, before any of it is allocated."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA

from foundry.distributed import host_memory
from foundry.distributed.placement import init_on_cpu
from foundry.errors import ConfigError
from foundry.models.build import build_model

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
