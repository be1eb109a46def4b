"""Every family with every attention backend this machine can run gives the reference (``torch``) logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import TINY_LLAMA, TINY_MPT

from foundry.errors import ConfigError
from foundry.models import LlamaCausalLM, MPTCausalLM

FAMILIES = {
    "mpt_alibi": (MPTCausalLM, {**TINY_MPT, "learned_pos_emb": False, "attn_config": {"alibi": True}}),
    "mpt_rope_gqa_qkln_clip": (
        MPTCausalLM,
        {**TINY_MPT, "learned_pos_emb": False,
         "attn_config": {"rope": True, "attn_type": "grouped_query_attention", "kv_n_heads": 2, "qk_ln": True,
                         "clip_qkv": 0.3}},
    ),
    # init_std 0.2 (not Llama's 0.02): attention then moves the logits enough for a wrong kernel to show
    "llama": (LlamaCausalLM, {**TINY_LLAMA, "init_std": 0.2,
                              "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 8}}),
}  # fmt: skip
PINNED_IMPLS = ("flash2", "cudnn")  # exactly one SDPA backend each: CUDA and bf16 only


def build(family: str, attn_impl: str, device: str = "cpu") -> torch.nn.Module:
    model_class, keys = FAMILIES[family]
    keys = {**keys, "init_device": device}
    if model_class is LlamaCausalLM:
        keys["attn_impl"] = attn_impl
    else:
        keys["attn_config"] = {**keys["attn_config"], "attn_impl": attn_impl}
    torch.manual_seed(0)
    return model_class(**keys)


def logits(model: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.Tensor:
    device = next(model.parameters()).device
    input_ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1)).to(device)
    model.eval()  # logits: in training, on a GPU, the forward returns the fused loss instead
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        return model({"input_ids": input_ids}).float()


def assert_close_in_bf16(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """bf16 keeps ~3 significant digits, so the bound is relative to the largest logit (a wrong kernel: >50%)."""
    max_error = (actual - expected).abs().max().item()
    assert max_error <= 0.03 * expected.abs().max().item(), f"max |error| {max_error:.4f}"


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_matches_torch_in_fp32(family: str) -> None:
    torch.testing.assert_close(logits(build(family, "sdpa")), logits(build(family, "torch")), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_matches_torch_in_bf16(family: str) -> None:
    reference = logits(build(family, "torch"))
    assert_close_in_bf16(logits(build(family, "sdpa"), torch.bfloat16), reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_flash_runs_a_fused_kernel_matching_torch_in_fp32_and_bf16(family: str) -> None:
    """``flash`` is SDPA on its fused backends only: on a CPU its flash kernel, ALiBi and GQA included."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    reference = logits(build(family, "torch", device))
    if device == "cpu":  # fused GPU kernels take bf16 only; the CPU's flash kernel also takes fp32
        torch.testing.assert_close(logits(build(family, "flash")), reference, atol=1e-5, rtol=1e-5)
    assert_close_in_bf16(logits(build(family, "flash", device), torch.bfloat16), reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash2 and cudnn run on CUDA GPUs only")
@pytest.mark.parametrize("attn_impl", PINNED_IMPLS)
@pytest.mark.parametrize("family", ["mpt_rope_gqa_qkln_clip", "llama"])
def test_pinned_backends_match_torch_in_bf16_on_gpu(family: str, attn_impl: str) -> None:
    reference = logits(build(family, "torch", "cuda"), torch.bfloat16)
    assert_close_in_bf16(logits(build(family, attn_impl, "cuda"), torch.bfloat16), reference)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
@pytest.mark.parametrize("attn_impl", PINNED_IMPLS)
def test_pinned_backends_on_cpu_raise_a_config_error_naming_sdpa(attn_impl: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{attn_impl}'.*CUDA.*'sdpa'"):
        logits(build("llama", attn_impl))


@pytest.mark.parametrize("attn_impl", PINNED_IMPLS)
def test_pinned_backends_refuse_alibi_at_config_time(attn_impl: str) -> None:
    with pytest.raises(ConfigError, match=r"alibi.*'sdpa'"):
        MPTCausalLM(**{**TINY_MPT, "attn_config": {"alibi": True, "attn_impl": attn_impl}})


@pytest.mark.parametrize(
    "feature",
    [{"alibi": True}, {"rope": True}, {"qk_ln": True}, {"clip_qkv": 0.05}],
    ids=["alibi", "rope", "qk_ln", "clip_qkv"],
)
def test_each_attention_feature_changes_the_model_output(feature: dict[str, Any]) -> None:
    """The same weights with and without the feature: identical logits would mean it was ignored."""
    plain = MPTCausalLM(**{**TINY_MPT, "learned_pos_emb": False, "attn_config": {"attn_impl": "torch"}})
    featured = MPTCausalLM(**{**TINY_MPT, "learned_pos_emb": False, "attn_config": {"attn_impl": "torch", **feature}})
    featured.load_state_dict(plain.state_dict(), strict=False)  # qk_ln's norms keep their init (weight 1)
    assert not torch.allclose(logits(plain), logits(featured), atol=1e-3)


def test_gqa_model_equals_mha_with_each_kv_head_repeated_for_its_query_heads() -> None:
    gqa_keys = {"attn_impl": "torch", "attn_type": "grouped_query_attention", "kv_n_heads": 2}
    gqa = MPTCausalLM(**{**TINY_MPT, "attn_config": gqa_keys})
    mha = MPTCausalLM(**{**TINY_MPT, "attn_config": {"attn_impl": "torch"}})
    d_model, head_dim = TINY_MPT["d_model"], TINY_MPT["d_model"] // TINY_MPT["n_heads"]
    state = gqa.state_dict()
    for name in [name for name in state if ".attn.Wqkv." in name]:  # weight and bias
        q, k, v = state[name].split([d_model, 2 * head_dim, 2 * head_dim])
        # kv head g serves query heads 2g and 2g + 1
        k, v = (w.unflatten(0, (2, head_dim)).repeat_interleave(2, dim=0).flatten(0, 1) for w in (k, v))
        state[name] = torch.cat([q, k, v])
    mha.load_state_dict(state)
    torch.testing.assert_close(logits(mha), logits(gqa), atol=1e-5, rtol=1e-5)
