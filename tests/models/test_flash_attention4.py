"""FlashAttention-4 behind ``attn_impl: flash`` / ``fa4``: when it is chosen, and the custom ops around it.

On a CPU the package's two entry points are stood in for by fp32 math with the same signatures, so
the op wiring (shapes, layouts, autograd, compile without graph breaks) is tested without a GPU; the
last test runs the real kernels against SDPA where a Hopper GPU and the package are present.
"""

from __future__ import annotations

import logging
import math
import re
import types
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from flash_attention4_reference import reference_bwd, reference_fwd, reference_interface
from helpers import builds_graphs

from foundry.errors import ConfigError
from foundry.models import attention as attention_module
from foundry.models import flash_attention4
from foundry.models.attention import ATTENTION_IMPLS, AttentionInputs, AttnConfig, torch_attention

BATCH, HEADS, KV_HEADS, SEQ, HEAD_DIM = 2, 4, 2, 16, 8


@pytest.fixture(autouse=True)
def fresh_choices() -> Iterator[None]:
    """The choice of kernel is cached per process (per shape): each test starts and leaves with none made."""
    caches = (flash_attention4._unsupported_reason, flash_attention4.interface_problem, flash_attention4.probe_problem)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


@pytest.fixture
def reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The package's entry points replaced by fp32 math, so the ops run on CPU tensors."""
    monkeypatch.setattr(flash_attention4, "_interface", reference_interface)


def _qkv(dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """q, k, v as the models make them: transposed views of one projection (batch, seq, width)."""
    torch.manual_seed(0)
    widths = [HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM]
    qkv = torch.randn(BATCH, SEQ, sum(widths), dtype=dtype, device=device, requires_grad=True)
    parts = (part.unflatten(-1, (-1, HEAD_DIM)).transpose(1, 2) for part in qkv.split(widths, dim=-1))
    return qkv, *parts


def _loss_and_grad(attention_fn, qkv, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    out = attention_fn(q, k, v)
    loss = (out.float() * torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)).sum()
    (grad,) = torch.autograd.grad(loss, qkv)
    return out, grad


def test_the_ops_give_the_output_and_gradients_of_causal_attention(reference_kernels: None) -> None:
    scale = 1 / math.sqrt(HEAD_DIM)
    out, grad = _loss_and_grad(lambda q, k, v: flash_attention4.flash_attention4(q, k, v, scale), *_qkv())
    expected_out, expected_grad = _loss_and_grad(
        lambda q, k, v: torch_attention(q, k, v, AttentionInputs(), scale, 0.0), *_qkv()
    )
    assert out.shape == (BATCH, HEADS, SEQ, HEAD_DIM)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(grad, expected_grad)


def test_a_compiled_function_keeps_the_ops_in_one_graph(reference_kernels: None) -> None:
    """fullgraph=True fails on any graph break: the ops must be opaque to dynamo, with fake shapes."""
    scale = 0.3
    compiled = torch.compile(lambda q, k, v: flash_attention4.flash_attention4(q, k, v, scale) * 2, fullgraph=True)
    with builds_graphs():
        out, grad = _loss_and_grad(compiled, *_qkv())
    expected_out, expected_grad = _loss_and_grad(
        lambda q, k, v: torch_attention(q, k, v, AttentionInputs(), scale, 0.0) * 2, *_qkv()
    )
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize(
    ("device_type", "dtype", "capability", "head_dim", "installed", "reason"),
    [
        ("cpu", torch.bfloat16, (9, 0), 64, True, "NVIDIA GPUs only"),
        ("cuda", torch.float32, (9, 0), 64, True, "fp16/bf16"),
        ("cuda", torch.bfloat16, (8, 0), 64, True, "compute capability 8.0"),
        ("cuda", torch.bfloat16, (9, 0), 60, True, "multiple of 8"),
        ("cuda", torch.bfloat16, (10, 0), 256, True, "at most 128"),
        ("cuda", torch.bfloat16, (9, 0), 256, False, "foundry\\[flash\\]"),
        ("cuda", torch.bfloat16, (9, 0), 256, True, None),
        ("cuda", torch.float16, (10, 0), 128, True, None),
    ],
)
def test_flash_attention4_runs_on_hopper_and_blackwell_in_half_precision_when_installed(
    monkeypatch: pytest.MonkeyPatch,
    device_type: str,
    dtype: torch.dtype,
    capability: tuple[int, int],
    head_dim: int,
    installed: bool,
    reason: str | None,
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability)
    monkeypatch.setattr(flash_attention4, "installed", lambda: installed)
    monkeypatch.setattr(flash_attention4, "interface_problem", lambda: "")
    monkeypatch.setattr(flash_attention4, "probe_problem", lambda *shape: "")
    found = flash_attention4.unsupported_reason(device_type, 0, dtype, head_dim, 8, 8)
    if reason is None:
        assert found == ""
    else:
        assert re.search(reason, found), found


def test_a_hopper_gpu_without_the_package_says_once_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(flash_attention4, "installed", lambda: False)
    with caplog.at_level(logging.INFO, logger=flash_attention4.__name__):
        for _ in range(3):
            flash_attention4.unsupported_reason("cuda", 0, torch.bfloat16, 64, 8, 8)
        flash_attention4.unsupported_reason("cuda", 0, torch.float32, 64, 8, 8)  # not fixable by installing
    hints = [record.getMessage() for record in caplog.records if "foundry[flash]" in record.getMessage()]
    assert len(hints) == 1, hints


@pytest.mark.parametrize(
    ("interface", "problem"),
    [
        (types.SimpleNamespace(_flash_attn_fwd=reference_fwd, _flash_attn_bwd=reference_bwd), None),
        (types.SimpleNamespace(_flash_attn_fwd=reference_fwd), "no flash_attn.cute.interface._flash_attn_bwd"),
        (
            types.SimpleNamespace(
                _flash_attn_fwd=lambda q, k, v, softmax_scale, causal: q, _flash_attn_bwd=reference_bwd
            ),
            "_flash_attn_fwd takes no out, lse, return_lse",
        ),
        (ImportError("libcute_dsl_runtime.so: cannot open shared object file"), "importing .* failed .*libcute"),
    ],
)
def test_an_installed_package_with_another_interface_is_a_reason_not_a_crash(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, interface: object, problem: str | None
) -> None:
    def load() -> object:
        if isinstance(interface, Exception):
            raise interface
        return interface

    monkeypatch.setattr(flash_attention4, "_interface", load)
    monkeypatch.setattr(flash_attention4, "installed", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (9, 0))
    monkeypatch.setattr(flash_attention4, "probe_problem", lambda *shape: "")
    with caplog.at_level(logging.WARNING, logger=flash_attention4.__name__):
        found = flash_attention4.unsupported_reason("cuda", 0, torch.bfloat16, 64, 8, 8)
    if problem is None:
        assert found == "" and not caplog.records
    else:
        assert re.search(problem, found), found
        assert "foundry[flash]" in found and len(caplog.records) == 1


def _raising(*args, **kwargs):
    raise RuntimeError("no tile configuration for this head width")


def _without_causal_mask(q, k, v, *, softmax_scale, causal, out, lse, return_lse):
    """A wrong kernel: the right layout and lse, but every query also attends to the future."""
    reference_fwd(q, k, v, softmax_scale=softmax_scale, causal=causal, out=out, lse=lse, return_lse=return_lse)
    q32, k32, v32 = (x.float().transpose(1, 2) for x in (q, k, v))
    k32, v32 = (x.repeat_interleave(q32.shape[1] // x.shape[1], dim=1) for x in (k32, v32))
    out.copy_(((q32 @ k32.transpose(-2, -1)) * softmax_scale).softmax(-1).matmul(v32).transpose(1, 2))


def _zero_dk(q, k, v, out, dout, lse, *, softmax_scale, causal, dq, dk, dv):
    reference_bwd(q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal, dq=dq, dk=dk, dv=dv)
    dk.zero_()


def _top_left_fwd(q, k, v, *, softmax_scale, causal, out, lse, return_lse):
    """A kernel aligning its causal mask to the first key (query i sees keys 0..i) when keys outnumber queries."""
    square = q.shape[1]
    return reference_fwd(
        q, k[:, :square], v[:, :square], softmax_scale=softmax_scale, causal=causal, out=out, lse=lse,
        return_lse=return_lse,
    )  # fmt: skip


def _top_left_bwd(q, k, v, out, dout, lse, *, softmax_scale, causal, dq, dk, dv):
    square = q.shape[1]
    dk.zero_(), dv.zero_()
    reference_bwd(
        q, k[:, :square], v[:, :square], out, dout, lse, softmax_scale=softmax_scale, causal=causal, dq=dq,
        dk=dk[:, :square], dv=dv[:, :square],
    )  # fmt: skip


END_ALIGNED = "for the last 144 of 192 queries against all keys"


@pytest.mark.parametrize(
    ("kernels", "problem"),
    [
        (reference_interface(), None),
        (reference_interface(fwd=_top_left_fwd), f"its output {END_ALIGNED} .* from fp32 math"),
        (reference_interface(bwd=_top_left_bwd), f"its dq {END_ALIGNED}"),
        (reference_interface(fwd=_raising), "kernels failed on a 192-token probe .*no tile configuration"),
        (reference_interface(bwd=_raising), "kernels failed"),
        (
            reference_interface(fwd=_without_causal_mask),
            "its output on a 192-token probe of this shape is .* from fp32 math",
        ),
        (reference_interface(bwd=_zero_dk), "its dk on a 192-token probe"),
    ],
)
def test_a_probe_of_each_shape_catches_kernels_that_fail_or_compute_wrong_attention(
    monkeypatch: pytest.MonkeyPatch, kernels: types.SimpleNamespace, problem: str | None
) -> None:
    monkeypatch.setattr(flash_attention4, "_interface", lambda: kernels)
    with torch.inference_mode():  # as when a shape is first seen during eval: the probe still differentiates
        found = flash_attention4.probe_problem(torch.device("cpu"), torch.float32, HEAD_DIM, HEADS, KV_HEADS)
    if problem is None:
        assert found == ""
    else:
        assert re.search(problem, found), found


def _installed_on_a_hopper_gpu(monkeypatch: pytest.MonkeyPatch, kernels: types.SimpleNamespace) -> None:
    """The package installed with these kernels on a Hopper GPU; the probe runs on CPU tensors (no GPU needed)."""
    monkeypatch.setattr(flash_attention4, "_interface", lambda: kernels)
    monkeypatch.setattr(flash_attention4, "installed", lambda: True)
    monkeypatch.setattr(flash_attention4, "interface_problem", lambda: "")
    # torch's own compile-time checks call it without an index
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    probe = flash_attention4.probe_problem
    monkeypatch.setattr(flash_attention4, "probe_problem", lambda device, *shape: probe(torch.device("cpu"), *shape))


def test_a_failed_probe_runs_sdpa_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _installed_on_a_hopper_gpu(monkeypatch, reference_interface(fwd=_without_causal_mask))
    with caplog.at_level(logging.WARNING, logger=flash_attention4.__name__):
        reasons = [
            flash_attention4.unsupported_reason("cuda", 0, torch.bfloat16, HEAD_DIM, HEADS, KV_HEADS) for _ in range(2)
        ]
    assert reasons[0] == reasons[1] and "from fp32 math" in reasons[0]
    assert len(caplog.records) == 1 and "cannot be used" in caplog.records[0].getMessage()


def test_the_probe_runs_while_torch_compile_traces_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under compile the choice is made at trace time (a constant): the probe must run there, on real tensors."""
    _installed_on_a_hopper_gpu(monkeypatch, reference_interface())

    def choose(x: torch.Tensor) -> torch.Tensor:
        reason = flash_attention4.unsupported_reason("cuda", 0, torch.bfloat16, HEAD_DIM, HEADS, KV_HEADS)
        return x * 3 if reason else x * 2

    with builds_graphs(), torch.autocast("cpu", dtype=torch.bfloat16):  # as inside a model's forward
        assert torch.equal(torch.compile(choose, fullgraph=True)(torch.ones(2)), torch.full((2,), 2.0))


def test_flash_runs_sdpa_where_flash_attention4_cannot(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU ``flash`` never reaches the package: the ops would raise if it did."""
    monkeypatch.setattr(flash_attention4, "_interface", lambda: pytest.fail("FlashAttention-4 ran on a CPU"))
    _, q, k, v = _qkv()
    out = ATTENTION_IMPLS["flash"](q, k, v, AttentionInputs(), 0.25, 0.0)
    expected = torch_attention(q, k, v, AttentionInputs(), 0.25, 0.0)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_flash_takes_flash_attention4_where_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain causal attention goes to FlashAttention-4; attention dropout or a mask goes to SDPA."""
    ran = []
    monkeypatch.setattr(attention_module, "_flash_attention4_unsupported", lambda q, k: "")
    monkeypatch.setattr(flash_attention4, "flash_attention4", lambda q, *args: ran.append("fa4") or q)
    monkeypatch.setattr(attention_module, "sdpa_attention", lambda q, *args: ran.append("sdpa") or q)
    _, q, k, v = _qkv()
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).tril()
    for inputs, dropout_p in [(AttentionInputs(), 0.0), (AttentionInputs(), 0.1), (AttentionInputs(allowed=mask), 0.0)]:
        ATTENTION_IMPLS["flash"](q, k, v, inputs, 0.25, dropout_p)
    assert ran == ["fa4", "sdpa", "sdpa"]


def test_pinned_fa4_names_why_it_cannot_run() -> None:
    _, q, k, v = _qkv()
    with pytest.raises(ConfigError, match="attn_impl' is 'fa4'.*NVIDIA GPUs only.*'flash'"):
        ATTENTION_IMPLS["fa4"](q, k, v, AttentionInputs(), 0.25, 0.0)


@pytest.mark.parametrize("keys", [{"alibi": True}, {"sliding_window_size": 4}, {"attn_pdrop": 0.1}])
def test_fa4_rejects_masks_and_dropout_in_the_config(keys: dict) -> None:
    with pytest.raises(ConfigError, match="fa4"):
        AttnConfig(attn_impl="fa4", **keys)


def _hopper_with_flash_attention4() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and flash_attention4.installed()


@pytest.mark.skipif(not _hopper_with_flash_attention4(), reason="needs a Hopper GPU and flash-attn-4")
def test_flash_attention4_matches_sdpa_on_a_hopper_gpu() -> None:
    assert flash_attention4.interface_problem() == ""  # the installed package has the entry points foundry calls
    # and its kernels pass the probe at the shipped configs' head shapes (MPT: 64 and 128 wide; Llama: GQA)
    for head_dim, heads, kv_heads in ((64, 12, 12), (128, 16, 16), (64, 32, 8)):
        assert flash_attention4.probe_problem(torch.device("cuda"), torch.bfloat16, head_dim, heads, kv_heads) == ""
    scale = 1 / math.sqrt(HEAD_DIM)
    out, grad = _loss_and_grad(
        lambda q, k, v: flash_attention4.flash_attention4(q, k, v, scale), *_qkv(torch.bfloat16, "cuda")
    )
    expected_out, expected_grad = _loss_and_grad(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
        *_qkv(torch.bfloat16, "cuda"),
    )
    torch.testing.assert_close(out, expected_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grad, expected_grad, atol=5e-2, rtol=5e-2)
