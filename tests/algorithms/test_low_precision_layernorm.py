"""low_precision_layernorm swaps norm classes in place: same parameters, same fp32 losses, close bf16 ones."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_LLAMA, TINY_MPT

from foundry.algorithms import LowPrecisionLayerNormAlgorithm
from foundry.algorithms.low_precision_layernorm import to_low_precision_norms
from foundry.models import LlamaCausalLM, MPTCausalLM
from foundry.models.layers import LowPrecisionLayerNorm, LowPrecisionRMSNorm


def test_layernorms_become_low_precision_with_the_same_parameters():
    model = MPTCausalLM({**TINY_MPT, "norm_type": "layernorm"})
    before = {name: p.clone() for name, p in model.named_parameters()}
    assert to_low_precision_norms(model) == 2 * TINY_MPT["n_layers"] + 1
    assert isinstance(model.transformer.norm_f, LowPrecisionLayerNorm)
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)


def test_rmsnorms_become_low_precision():
    model = LlamaCausalLM(TINY_LLAMA)
    to_low_precision_norms(model)
    assert isinstance(model.transformer.norm_f, LowPrecisionRMSNorm)


def test_fp32_losses_are_unchanged(train):
    mpt = {"norm_type": "layernorm"}
    _, plain = train(model_keys=mpt)
    _, swapped = train([LowPrecisionLayerNormAlgorithm()], model_keys=mpt)
    assert swapped == plain


def test_bf16_losses_stay_within_bf16_rounding(train):
    mpt = {"norm_type": "layernorm"}
    _, plain = train(model_keys=mpt, precision="amp_bf16")
    _, swapped = train([LowPrecisionLayerNormAlgorithm()], model_keys=mpt, precision="amp_bf16")
    assert swapped == pytest.approx(plain, abs=2e-2)
