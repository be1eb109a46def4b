"""The KV cache: decoding a left-padded batch token by token gives the logits of the full forward."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_DECODERS, build_tiny_decoder
from torch.utils._python_dispatch import TorchDispatchMode

from foundry.errors import FoundryError
from foundry.models.kv_cache import KVCache

PROMPT_LEN, DECODE_STEPS = 8, 4


@pytest.fixture
def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Three rows of 12 tokens; rows 0 and 1 are left-padded by 4 and 1 (attention_mask 0)."""
    input_ids = torch.randint(0, 96, (3, PROMPT_LEN + DECODE_STEPS), generator=torch.Generator().manual_seed(2))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :4] = 0
    attention_mask[1, :1] = 0
    return input_ids, attention_mask


class _HostReads(TorchDispatchMode):
    """Counts ops that read a tensor value on the host (``.item()``, ``int(tensor)``, ``bool(tensor)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def decode_with_cache(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, length_on_device: bool = False
) -> torch.Tensor:
    """Logits (rows, seq, vocab) from a prefill of PROMPT_LEN tokens, then one token per step.

    With ``length_on_device`` the decode steps run as a CUDA graph would capture them: the cache's
    length a device tensor, and no value read back to the host.
    """
    cache = model.new_kv_cache(input_ids.shape[1])
    prompt = {"input_ids": input_ids[:, :PROMPT_LEN], "attention_mask": attention_mask[:, :PROMPT_LEN]}
    logits = [model(prompt, cache=cache)]
    if length_on_device:
        cache.keep_length_on_device(input_ids.device)
    for column in range(PROMPT_LEN, input_ids.shape[1]):
        with _HostReads() as host_reads:
            logits.append(model({"input_ids": input_ids[:, column : column + 1]}, cache=cache))
        assert host_reads.count == 0 or not length_on_device
    assert int(cache.length) == input_ids.shape[1]
    return torch.cat(logits, dim=1)


# Every position scheme with sdpa; the torch kernel's own masking path with ALiBi and with GQA.
KERNEL_CASES = [(variant, "sdpa") for variant in TINY_DECODERS] + [("mpt_alibi", "torch"), ("llama_gqa", "torch")]


@pytest.mark.parametrize("length_on_device", [False, True], ids=["host_length", "device_length"])
@pytest.mark.parametrize(("variant", "attn_impl"), KERNEL_CASES)
@torch.no_grad()
def test_cached_decoding_gives_the_full_forward_logits(variant, attn_impl, length_on_device, padded_batch) -> None:
    model = build_tiny_decoder(variant, attn_impl)
    input_ids, attention_mask = padded_batch
    full = model({"input_ids": input_ids, "attention_mask": attention_mask})
    cached = decode_with_cache(model, input_ids, attention_mask, length_on_device)
    real = attention_mask.bool()  # padding positions' outputs are never used
    torch.testing.assert_close(cached[real], full[real], atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_cache_with_its_length_on_the_device_takes_no_more_padded_prompts(padded_batch) -> None:
    model = build_tiny_decoder("mpt_learned_pos_emb")
    input_ids, attention_mask = padded_batch
    cache = model.new_kv_cache(input_ids.shape[1])
    with pytest.raises(FoundryError, match="keep_length_on_device"):
        cache.keep_length_on_device(input_ids.device)  # nothing cached yet
    model({"input_ids": input_ids[:, :PROMPT_LEN], "attention_mask": attention_mask[:, :PROMPT_LEN]}, cache=cache)
    cache.keep_length_on_device(input_ids.device)
    with pytest.raises(FoundryError, match="without an attention_mask"):
        model({"input_ids": input_ids[:, PROMPT_LEN:], "attention_mask": attention_mask[:, PROMPT_LEN:]}, cache=cache)


@torch.no_grad()
def test_sliding_window_applies_to_cached_keys(padded_batch) -> None:
    model = build_tiny_decoder("mpt_alibi")
    model.config.attn_config.sliding_window_size = 2  # one AttnConfig object serves every layer
    input_ids, attention_mask = padded_batch
    full = model({"input_ids": input_ids, "attention_mask": attention_mask})
    unwindowed = build_tiny_decoder("mpt_alibi")({"input_ids": input_ids, "attention_mask": attention_mask})
    assert not torch.allclose(full, unwindowed)  # the window matters for these logits
    cached = decode_with_cache(model, input_ids, attention_mask)
    torch.testing.assert_close(cached[attention_mask.bool()], full[attention_mask.bool()], atol=1e-5, rtol=0)


@torch.no_grad()
def test_cache_buffers_take_the_dtype_the_keys_are_computed_in() -> None:
    model = build_tiny_decoder("llama_gqa")
    cache = model.new_kv_cache(6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model({"input_ids": torch.zeros(2, 4, dtype=torch.long)}, cache=cache)
    keys = cache.layers[0].keys
    assert keys.dtype == torch.bfloat16
    assert keys.shape == (2, model.config.attn_config.kv_n_heads, 6, model.config.head_dim)
    assert cache.length == 4


def test_adding_more_tokens_than_the_cache_holds_fails_naming_max_len() -> None:
    model = build_tiny_decoder("mpt_learned_pos_emb")
    cache = model.new_kv_cache(4)
    with pytest.raises(FoundryError, match="max_len"):
        model({"input_ids": torch.zeros(1, 5, dtype=torch.long)}, cache=cache)


def test_a_cached_forward_rejects_sequence_id() -> None:
    model = build_tiny_decoder("mpt_learned_pos_emb")
    batch = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "sequence_id": torch.zeros(1, 3, dtype=torch.long)}
    with pytest.raises(FoundryError, match="sequence_id"):
        model(batch, cache=KVCache(n_layers=2, max_len=4))


@torch.no_grad()
def test_cached_attention_keeps_cudnn_off_and_plain_forwards_leave_it_on(
    padded_batch, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuDNN's per-call setup bounds decoding by the host; training and scoring forwards keep every backend."""
    cudnn_allowed = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        cudnn_allowed.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    model = build_tiny_decoder("llama_gqa", "sdpa")
    input_ids, attention_mask = padded_batch
    model({"input_ids": input_ids})
    assert cudnn_allowed and all(cudnn_allowed)
    cudnn_allowed.clear()
    decode_with_cache(model, input_ids, attention_mask)
    assert cudnn_allowed and not any(cudnn_allowed)
