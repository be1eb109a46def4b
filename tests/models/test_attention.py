"""Each attention feature against a hand-written float64 reference, and the kernels against each other."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from foundry.errors import ConfigError
from foundry.models.attention import Attention, AttnConfig, build_attention_inputs

D_MODEL, N_HEADS, SEQ = 32, 4, 8
HEAD_DIM = D_MODEL // N_HEADS
ALIBI_SLOPES_4_HEADS = [2**-2, 2**-4, 2**-6, 2**-8]  # 2^(-8h/4), h = 1..4


def make_attention(seed: int = 0, **keys: Any) -> Attention:
    torch.manual_seed(seed)
    attention = Attention(D_MODEL, N_HEADS, AttnConfig(**{"attn_impl": "torch", **keys}), norm_type="layernorm")
    for norm in (getattr(attention, "q_ln", None), getattr(attention, "k_ln", None)):
        if norm is not None:  # non-trivial norm weights, so a skipped norm shows
            torch.nn.init.normal_(norm.weight, mean=1.0, std=0.5)
            torch.nn.init.normal_(norm.bias, std=0.5)
    return attention


def run(attention: Attention, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    positions = torch.arange(x.shape[1])[None]
    inputs = build_attention_inputs(attention.config, N_HEADS, HEAD_DIM, x.shape[1], positions, key_padding_mask)
    return attention(x, inputs)


def rotate(x: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """RoPE of one head vector: pair (m, m + d/2) turns by position * theta^(-2m/d)."""
    half = x.shape[-1] // 2
    out = x.clone()
    for m in range(half):
        angle = position * theta ** (-2 * m / x.shape[-1])
        a, b = x[..., m], x[..., m + half]
        cos, sin = math.cos(angle), math.sin(angle)
        out[..., m], out[..., m + half] = a * cos - b * sin, a * sin + b * cos
    return out


def reference(
    attention: Attention,
    x: torch.Tensor,
    alibi_slopes: list[float] | None = None,
    rope_theta: float | None = None,
    window: int = -1,
    key_padding_mask: torch.Tensor | None = None,
    kv_head_of: Any = None,
) -> torch.Tensor:
    """The formulas, one head and one query at a time, in float64."""
    config, kv_heads = attention.config, attention.kv_n_heads
    qkv = F.linear(x.double(), attention.Wqkv.weight.double(), attention.Wqkv.bias.double())
    if config.clip_qkv is not None:
        qkv = qkv.clamp(-config.clip_qkv, config.clip_qkv)
    q, k, v = qkv.split([D_MODEL, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], dim=-1)
    if config.qk_ln or config.qk_gn:
        q, k = (_layer_norm(t, norm, per_head=config.qk_gn) for t, norm in ((q, attention.q_ln), (k, attention.k_ln)))
    scale = config.softmax_scale or 1 / math.sqrt(HEAD_DIM)
    kv_head_of = kv_head_of or (lambda h: h // (N_HEADS // kv_heads))
    batch, seq = x.shape[:2]
    out = torch.zeros(batch, seq, N_HEADS, HEAD_DIM, dtype=torch.float64)
    for b in range(batch):
        for h in range(N_HEADS):
            g = kv_head_of(h)
            for i in range(seq):
                qi = q[b, i, h * HEAD_DIM : (h + 1) * HEAD_DIM]
                keys = k[b, :, g * HEAD_DIM : (g + 1) * HEAD_DIM]
                if rope_theta is not None:
                    qi = rotate(qi, i, rope_theta)
                    keys = torch.stack([rotate(keys[j], j, rope_theta) for j in range(seq)])
                scores = keys @ qi * scale
                for j in range(seq):
                    if alibi_slopes is not None:
                        scores[j] -= alibi_slopes[h] * (i - j)
                    padded = key_padding_mask is not None and not key_padding_mask[b, j]
                    if j > i or (window >= 0 and i - j > window) or padded:
                        scores[j] = float("-inf")
                out[b, i, h] = scores.softmax(0) @ v[b, :, g * HEAD_DIM : (g + 1) * HEAD_DIM]
    projection = attention.out_proj
    return F.linear(out.flatten(2), projection.weight.double(), projection.bias.double()).float()


def _layer_norm(x: torch.Tensor, norm: torch.nn.LayerNorm, per_head: bool) -> torch.Tensor:
    weight, bias = norm.weight.double(), norm.bias.double()
    if per_head:
        heads = x.unflatten(-1, (-1, HEAD_DIM))
        return F.layer_norm(heads, (HEAD_DIM,), weight, bias, norm.eps).flatten(-2)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, norm.eps)


@pytest.fixture
def x() -> torch.Tensor:
    return torch.randn(2, SEQ, D_MODEL, generator=torch.Generator().manual_seed(3))


def test_plain_causal_attention_matches_reference(x: torch.Tensor) -> None:
    attention = make_attention()
    torch.testing.assert_close(run(attention, x), reference(attention, x), atol=1e-5, rtol=1e-5)


def test_gqa_shares_each_kv_head_with_consecutive_query_heads(x: torch.Tensor) -> None:
    attention = make_attention(attn_type="grouped_query_attention", kv_n_heads=2)
    out = run(attention, x)
    torch.testing.assert_close(out, reference(attention, x), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, reference(attention, x, kv_head_of=lambda h: h % 2), atol=1e-3)


def test_multiquery_attention_has_one_kv_head(x: torch.Tensor) -> None:
    attention = make_attention(attn_type="multiquery_attention")
    assert attention.Wqkv.out_features == D_MODEL + 2 * HEAD_DIM
    torch.testing.assert_close(run(attention, x), reference(attention, x), atol=1e-5, rtol=1e-5)


def test_alibi_adds_a_per_head_distance_bias(x: torch.Tensor) -> None:
    attention = make_attention(alibi=True)
    out = run(attention, x)
    torch.testing.assert_close(out, reference(attention, x, alibi_slopes=ALIBI_SLOPES_4_HEADS), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, reference(attention, x), atol=1e-3)


def test_rope_rotates_queries_and_keys_by_position(x: torch.Tensor) -> None:
    attention = make_attention(rope=True, rope_theta=100.0)
    out = run(attention, x)
    torch.testing.assert_close(out, reference(attention, x, rope_theta=100.0), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, reference(attention, x), atol=1e-3)


def test_qk_ln_normalises_queries_and_keys(x: torch.Tensor) -> None:
    attention = make_attention(qk_ln=True)
    out = run(attention, x)
    torch.testing.assert_close(out, reference(attention, x), atol=1e-5, rtol=1e-5)
    attention.config = AttnConfig(attn_impl="torch")  # same weights, norm off
    assert not torch.allclose(out, reference(attention, x), atol=1e-3)


def test_qk_gn_normalises_each_head(x: torch.Tensor) -> None:
    attention = make_attention(qk_gn=True)
    assert attention.q_ln.weight.shape == (HEAD_DIM,)
    torch.testing.assert_close(run(attention, x), reference(attention, x), atol=1e-5, rtol=1e-5)


def test_clip_qkv_clamps_the_projection(x: torch.Tensor) -> None:
    attention = make_attention(clip_qkv=0.1)
    out = run(attention, x)
    torch.testing.assert_close(out, reference(attention, x), atol=1e-5, rtol=1e-5)
    attention.config = AttnConfig(attn_impl="torch")
    assert not torch.allclose(out, reference(attention, x), atol=1e-3)


def test_softmax_scale_replaces_inverse_sqrt_head_dim(x: torch.Tensor) -> None:
    attention = make_attention(softmax_scale=2.0)
    out = run(attention, x)
    torch.testing.assert_close(out, reference(attention, x), atol=1e-5, rtol=1e-5)
    attention.config = AttnConfig(attn_impl="torch")
    assert not torch.allclose(out, reference(attention, x), atol=1e-3)


def test_sliding_window_hides_keys_further_back_than_the_window(x: torch.Tensor) -> None:
    attention = make_attention(sliding_window_size=2)
    out = run(attention, x)
    torch.testing.assert_close(out, reference(attention, x, window=2), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, reference(attention, x), atol=1e-3)


def test_padding_keys_are_masked(x: torch.Tensor) -> None:
    attention = make_attention()
    key_padding_mask = torch.ones(2, SEQ, dtype=torch.bool)
    key_padding_mask[1, :3] = False  # left padding: real queries could otherwise see the pads
    out = run(attention, x, key_padding_mask)
    expected = reference(attention, x, key_padding_mask=key_padding_mask)
    torch.testing.assert_close(out[key_padding_mask], expected[key_padding_mask], atol=1e-5, rtol=1e-5)


FEATURES = [
    {},
    {"alibi": True},
    {"rope": True},
    {"attn_type": "grouped_query_attention", "kv_n_heads": 2},
    {"sliding_window_size": 3, "qk_ln": True, "clip_qkv": 0.5},
]


@pytest.mark.parametrize("features", FEATURES, ids=lambda f: ",".join(f) or "plain")
def test_sdpa_matches_torch_in_fp32(x: torch.Tensor, features: dict[str, Any]) -> None:
    torch_attention = make_attention(**features)
    sdpa_attention = make_attention(**features, attn_impl="sdpa")
    sdpa_attention.load_state_dict(torch_attention.state_dict())
    key_padding_mask = torch.ones(2, SEQ, dtype=torch.bool)
    key_padding_mask[0, 5:] = False
    for padding in (None, key_padding_mask):
        expected = run(torch_attention, x, padding)
        torch.testing.assert_close(run(sdpa_attention, x, padding), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("features", [{}, {"alibi": True}], ids=["plain", "alibi"])
def test_sdpa_matches_torch_in_bf16(x: torch.Tensor, features: dict[str, Any]) -> None:
    torch_attention = make_attention(**features).to(torch.bfloat16)
    sdpa_attention = make_attention(**features, attn_impl="sdpa").to(torch.bfloat16)
    sdpa_attention.load_state_dict(torch_attention.state_dict())
    x = x.to(torch.bfloat16)
    torch.testing.assert_close(run(sdpa_attention, x), run(torch_attention, x), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_flash2_on_cpu_raises_a_config_error_naming_sdpa(x: torch.Tensor) -> None:
    attention = make_attention(attn_impl="flash2")
    with pytest.raises(ConfigError, match="attn_impl.*flash2.*CUDA.*sdpa"):
        run(attention, x)


def test_flash2_with_alibi_is_rejected_at_config_time() -> None:
    with pytest.raises(ConfigError, match="alibi.*'sdpa'"):
        AttnConfig(attn_impl="flash2", alibi=True)


@pytest.mark.parametrize(
    "features", [{}, {"alibi": True}, {"sliding_window_size": 3}], ids=["plain", "alibi", "window"]
)
def test_flash_runs_masks_and_biases_on_a_fused_kernel(x: torch.Tensor, features: dict[str, Any]) -> None:
    reference = make_attention(**features)
    flash = make_attention(**features, attn_impl="flash")
    flash.load_state_dict(reference.state_dict())
    torch.testing.assert_close(run(flash, x), run(reference, x), atol=1e-5, rtol=1e-5)


def test_flash_with_no_fused_kernel_for_the_input_names_sdpa(x: torch.Tensor, monkeypatch) -> None:
    from foundry.models import attention as attention_module

    monkeypatch.setattr(attention_module, "FUSED_BACKENDS", [])  # as if no fused kernel took this input
    with pytest.raises(ConfigError, match="attn_impl' is 'flash', but no fused attention kernel.*'sdpa'"):
        run(make_attention(attn_impl="flash"), x)
