"""low_precision_residual: the residual stream runs in the autocast dtype; fp32 runs are untouched."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_MPT

from foundry.algorithms import LowPrecisionResidual
from foundry.core.precision import cast_embeddings_to_autocast_dtype
from foundry.models import MPTCausalLM


def _block_input_dtype(model: MPTCausalLM) -> torch.dtype:
    seen: list[torch.dtype] = []
    handle = model.transformer.blocks[1].register_forward_pre_hook(lambda module, args: seen.append(args[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model({"input_ids": torch.randint(0, TINY_MPT["vocab_size"], (2, 8))})
    handle.remove()
    return seen[0]


def test_residual_stream_runs_in_the_autocast_dtype():
    torch.manual_seed(0)
    model = MPTCausalLM(TINY_MPT)
    assert _block_input_dtype(model) == torch.float32  # fp32 lookup promotes every residual add
    assert cast_embeddings_to_autocast_dtype(model) == 2  # wte and the learned wpe
    assert _block_input_dtype(model) == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_hooking_twice_casts_once():
    model = MPTCausalLM(TINY_MPT)
    cast_embeddings_to_autocast_dtype(model)
    cast_embeddings_to_autocast_dtype(model)
    assert len(model.transformer.wte._forward_hooks) == 1


def test_fp32_losses_are_unchanged(train):
    _, plain = train()
    algorithm = LowPrecisionResidual()
    _, hooked = train([algorithm])
    assert hooked == plain
    assert algorithm.num_hooked == 2


def test_bf16_losses_stay_within_bf16_rounding(train):
    _, plain = train(precision="amp_bf16")
    _, hooked = train([LowPrecisionResidual()], precision="amp_bf16")
    assert hooked == pytest.approx(plain, abs=2e-2)
    assert hooked != plain  # the residual really ran in bf16
