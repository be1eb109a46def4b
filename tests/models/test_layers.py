"""Norms, feed-forward networks and positional encodings against hand-computed values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foundry.errors import ConfigError
from foundry.models.experts import GroupedExperts
from foundry.models.layers import (
    GLU,
    MLP,
    ActFnConfig,
    FFNConfig,
    LowPrecisionLayerNorm,
    RMSNorm,
    alibi_slopes,
    apply_rope,
    build_ffn,
    ffn_hidden_size,
    rope_cos_sin,
    rope_inv_freq,
)


def test_alibi_slopes_for_a_power_of_two_head_count() -> None:
    torch.testing.assert_close(alibi_slopes(4, alibi_bias_max=8), torch.tensor([2**-2, 2**-4, 2**-6, 2**-8]))


def test_alibi_slopes_for_six_heads_interleave_those_of_eight() -> None:
    # slopes of 8 heads are 2^-1 .. 2^-8; LLM Foundry takes the odd ones, then the even ones, then cuts to 6.
    expected = torch.tensor([2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    torch.testing.assert_close(alibi_slopes(6, alibi_bias_max=8), expected)


def test_rope_dot_products_depend_only_on_relative_position() -> None:
    q, k = torch.randn(2, 1, 1, 1, 8).unbind(0)  # each (1, 1, 1, head_dim)

    def rotated_dot(query_pos: int, key_pos: int) -> torch.Tensor:
        cos, sin = rope_cos_sin(torch.tensor([[query_pos, key_pos]]), rope_inv_freq(8, 10000.0))
        return (apply_rope(q, cos[:, :1], sin[:, :1]) * apply_rope(k, cos[:, 1:], sin[:, 1:])).sum()

    torch.testing.assert_close(rotated_dot(7, 3), rotated_dot(104, 100))
    assert not torch.allclose(rotated_dot(7, 3), rotated_dot(7, 5))


def test_rope_at_position_zero_is_the_identity() -> None:
    x = torch.randn(1, 1, 2, 8)
    cos, sin = rope_cos_sin(torch.zeros(1, 1, dtype=torch.long), rope_inv_freq(8, 10000.0))
    torch.testing.assert_close(apply_rope(x, cos, sin), x)


def test_rmsnorm_divides_by_root_mean_square() -> None:
    norm = RMSNorm(2, eps=0.0)
    torch.testing.assert_close(norm(torch.tensor([[3.0, 4.0]])), torch.tensor([[3.0, 4.0]]) / (12.5**0.5))


def test_low_precision_layernorm_computes_in_the_autocast_dtype() -> None:
    norm = LowPrecisionLayerNorm(8)
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(x)
        reference = torch.nn.LayerNorm(8)(x)
    assert out.dtype == torch.bfloat16
    assert reference.dtype == torch.float32  # autocast keeps a plain LayerNorm in fp32
    torch.testing.assert_close(out.float(), F.layer_norm(x, (8,)), atol=3e-2, rtol=3e-2)


def test_glu_gates_the_up_projection() -> None:
    ffn = build_ffn(FFNConfig(ffn_type="mptglu", ffn_act_fn=ActFnConfig(name="silu")), 8, 2)
    assert isinstance(ffn, GLU)
    x = torch.randn(3, 8)
    expected = ffn.down_proj(F.silu(ffn.gate_proj(x)) * ffn.up_proj(x))
    torch.testing.assert_close(ffn(x), expected)


@pytest.mark.parametrize(
    ("act", "expected"),
    [
        (ActFnConfig("gelu"), F.gelu),
        (ActFnConfig("gelu", approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
        (ActFnConfig("silu"), F.silu),
        (ActFnConfig("relu"), F.relu),
    ],
)
def test_dense_and_expert_layers_apply_the_named_activation(act, expected) -> None:
    x = torch.randn(4, 8)
    for layer in (MLP(8, 16, act), GroupedExperts(2, 8, 16, act, glu=False)):
        torch.testing.assert_close(layer.act(x), expected(x), atol=0, rtol=0)


def test_ffn_hidden_size_overrides_expansion_ratio() -> None:
    assert ffn_hidden_size(32, 4, FFNConfig(ffn_hidden_size=100)) == 100
    assert ffn_hidden_size(32, 2.5, FFNConfig()) == 80


def test_fractional_ffn_width_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="expansion_ratio.*ffn_hidden_size"):
        ffn_hidden_size(10, 1.25, FFNConfig())
