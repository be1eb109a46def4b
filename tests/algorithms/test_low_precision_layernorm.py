"""low_precision_layernorm swaps norm classes in place: same parameters, same fp32 losses, close bf16 ones."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_LLAMA, TINY_MPT

from foundry.algorithms import LowPrecisionLayerNormAlgorithm
from foundry.algorithms.low_precision_layernorm import to_low_precision_norms
from foundry.models import LlamaCausalLM, MPTCausalLM
from foundry.models.layers import LowPrecisionLayerNorm, LowPrecisionRMSNorm


@pytest.mark.parametrize(
    ("model", "low_precision_norm"),
    [
        (lambda: MPTCausalLM({**TINY_MPT, "norm_type": "layernorm"}), LowPrecisionLayerNorm),
        (lambda: LlamaCausalLM(TINY_LLAMA), LowPrecisionRMSNorm),
    ],
    ids=["layernorm", "rmsnorm"],
)
def test_every_norm_becomes_low_precision_with_the_same_parameters(model, low_precision_norm):
    model = model()
    before = {name: p.clone() for name, p in model.named_parameters()}
    assert to_low_precision_norms(model) == 2 * TINY_MPT["n_layers"] + 1  # two per block and the final one
    norms = {name: type(module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1].startswith("norm")}
    assert len(norms) == 2 * TINY_MPT["n_layers"] + 1
    assert set(norms.values()) == {low_precision_norm}
    after = dict(model.named_parameters())
    assert before.keys() == after.keys()
    assert all(torch.equal(before[name], after[name]) for name in before)


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
