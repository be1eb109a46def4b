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
    "llama": (LlamaCausalLM, {**TINY_LLAMA, "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 8}}),
}  # fmt: skip
FUSED_IMPLS = ("flash", "cudnn")


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
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        return model({"input_ids": input_ids}).float()


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_matches_torch_in_fp32(family: str) -> None:
    torch.testing.assert_close(logits(build(family, "sdpa")), logits(build(family, "torch")), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_sdpa_matches_torch_in_bf16(family: str) -> None:
    reference = logits(build(family, "torch"))
    torch.testing.assert_close(logits(build(family, "sdpa"), torch.bfloat16), reference, atol=0.1, rtol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash and cudnn run on CUDA GPUs only")
@pytest.mark.parametrize("attn_impl", FUSED_IMPLS)
@pytest.mark.parametrize("family", ["mpt_rope_gqa_qkln_clip", "llama"])
def test_fused_backends_match_torch_in_bf16_on_gpu(family: str, attn_impl: str) -> None:
    reference = logits(build(family, "torch", "cuda"), torch.bfloat16)
    torch.testing.assert_close(
        logits(build(family, attn_impl, "cuda"), torch.bfloat16), reference, atol=0.05, rtol=0.05
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
@pytest.mark.parametrize("attn_impl", FUSED_IMPLS)
def test_fused_backends_on_cpu_raise_a_config_error_naming_sdpa(attn_impl: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{attn_impl}'.*CUDA.*'sdpa'"):
        logits(build("llama", attn_impl))


@pytest.mark.parametrize("attn_impl", FUSED_IMPLS)
def test_fused_backends_refuse_alibi_at_config_time(attn_impl: str) -> None:
    with pytest.raises(ConfigError, match=r"alibi.*'sdpa'"):
        MPTCausalLM(**{**TINY_MPT, "attn_config": {"alibi": True, "attn_impl": attn_impl}})


@pytest.mark.parametrize(
    "feature",
    [{"alibi": True}, {"rope": True}, {"qk_ln": True}, {"clip_qkv": 0.05},
     {"attn_type": "grouped_query_attention", "kv_n_heads": 2}],
    ids=["alibi", "rope", "qk_ln", "clip_qkv", "gqa"],
)  # fmt: skip
def test_each_attention_feature_changes_the_model_output(feature: dict[str, Any]) -> None:
    """Same seed with and without the feature: identical logits would mean it was ignored."""
    torch.manual_seed(0)
    plain = MPTCausalLM(**{**TINY_MPT, "learned_pos_emb": False, "attn_config": {"attn_impl": "torch"}})
    torch.manual_seed(0)
    featured = MPTCausalLM(**{**TINY_MPT, "learned_pos_emb": False, "attn_config": {"attn_impl": "torch", **feature}})
    assert not torch.allclose(logits(plain), logits(featured), atol=1e-4)
