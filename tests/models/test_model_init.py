"""Parameter init: LLM Foundry's schemes, and meta-device init equal to CPU init."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from foundry.models import MPTCausalLM

MakeMPT = Callable[..., MPTCausalLM]


def test_meta_init_then_init_weights_equals_cpu_init(make_mpt: MakeMPT) -> None:
    on_cpu = make_mpt(seed=5)
    on_meta = make_mpt(init_device="meta")
    assert all(p.is_meta for p in on_meta.parameters())
    on_meta.to_empty(device="cpu")
    torch.manual_seed(5)
    on_meta.init_weights()
    for (name, expected), actual in zip(on_cpu.state_dict().items(), on_meta.state_dict().values()):
        torch.testing.assert_close(actual, expected, msg=name)


def test_kaiming_normal_default_scales_residual_projections_by_depth(make_mpt: MakeMPT) -> None:
    model = make_mpt(d_model=128, n_layers=2)
    block = model.transformer.blocks[0]
    kaiming_std = math.sqrt(2 / 128)  # relu gain, fan_in = d_model
    assert block.attn.Wqkv.weight.std().item() == pytest.approx(kaiming_std, rel=0.05)
    assert block.attn.out_proj.weight.std().item() == pytest.approx(kaiming_std / math.sqrt(2 * 2), rel=0.05)
    assert block.ffn.up_proj.bias.abs().sum() == 0
    assert torch.equal(block.norm_1.weight, torch.ones(128))


def test_fused_wqkv_is_initialised_one_head_at_a_time(make_mpt: MakeMPT) -> None:
    # fan_out of one head's slice is head_dim (32), not the fused 3 * d_model (384)
    model = make_mpt(d_model=128, init_config={"fan_mode": "fan_out"})
    std = model.transformer.blocks[0].attn.Wqkv.weight.std().item()
    assert std == pytest.approx(math.sqrt(2 / 32), rel=0.05)


def test_emb_init_std_sets_the_embedding_std(make_mpt: MakeMPT) -> None:
    model = make_mpt(d_model=128, init_config={"emb_init_std": 0.02})
    assert model.transformer.wte.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_init_div_is_residual_false_leaves_residual_projections_unscaled(make_mpt: MakeMPT) -> None:
    model = make_mpt(d_model=128, init_config={"init_div_is_residual": False})
    block = model.transformer.blocks[0]
    assert block.attn.out_proj.weight.std().item() == pytest.approx(math.sqrt(2 / 128), rel=0.05)
