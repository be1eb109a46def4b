"""Causal self-attention with LLM Foundry's ``attn_config``: MHA/GQA/MQA, RoPE, ALiBi, QK norm, clipping.

Six kernels compute the same thing, chosen by ``attn_impl``:

- ``sdpa``: ``F.scaled_dot_product_attention``; torch picks the fastest backend that can run.
- ``flash``: the fastest fused, flash-class kernel for the input: on a GPU, FlexAttention when a mask
  or bias is needed (document masking, ALiBi, sliding window, padding); otherwise FlashAttention-4
  (``foundry/models/flash_attention4.py``) on a Hopper or Blackwell GPU where the optional package is
  installed, else SDPA restricted to its fused backends (cuDNN, FlashAttention-2, memory-efficient);
  on a CPU, SDPA's fused backends (its flash kernel). Never the unfused math fallback. LLM Foundry
  YAMLs write ``flash`` to ask for a FlashAttention-class kernel; on an H100 FlashAttention-4 and
  cuDNN's kernel are both faster than FlashAttention-2's, so pinning FA2 would lose 3-7% of a step.
- ``flex``: FlexAttention (``foundry/models/flex_attention.py``) for every forward on a GPU, masked or
  not; on a CPU, where it has no backward, SDPA with the same masks (with a warning).
- ``flash2``: exactly FlashAttention-2 (CUDA, fp16/bf16, no mask); fails rather than run another kernel.
- ``cudnn``: exactly cuDNN's fused attention (CUDA, fp16/bf16, no mask).
- ``fa4``: exactly FlashAttention-4 (Hopper/Blackwell, fp16/bf16, no mask, no dropout, ``foundry[flash]``).
- ``torch``: the explicit math, ``softmax(QK^T * scale + bias + mask) V`` in fp32; the reference.

Masks and biases that every layer shares (padding, sliding window, ALiBi, RoPE angles) are built
once per forward by ``build_attention_inputs``: dense for SDPA and the reference, as a FlexAttention
``BlockMask`` and score modifier where FlexAttention runs. A kernel that cannot apply one of them raises; none
is ever dropped. When decoding with a ``KVCache`` (``foundry/models/kv_cache.py``) the queries are
the new tokens and the keys every cached column, so a mask is always needed: ``torch`` then runs as
itself and every other kernel as ``sdpa`` without cuDNN (``cached_sdpa_attention``). To add a
kernel (e.g. Triton in ``foundry/kernels``), register a function with the signature of
``torch_attention`` in ``ATTENTION_IMPLS`` under a new name before building the model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask

from foundry.errors import ConfigError, did_you_mean
from foundry.models import flash_attention4
from foundry.models.flex_attention import ScoreMod, alibi_score_mod, block_mask, flex_attention_fn, flex_runs_on
from foundry.models.kv_cache import LayerKVCache
from foundry.models.layers import (
    NormType,
    alibi_slopes,
    apply_rope,
    build_norm,
    llama3_scaled_inv_freq,
    rope_cos_sin,
    rope_inv_freq,
)

AttnType = Literal["multihead_attention", "grouped_query_attention", "multiquery_attention"]
AttnImpl = str  # a key of ATTENTION_IMPLS: sdpa, flash, flash2, cudnn, fa4, flex, torch, or a registered kernel
PINNED_IMPLS = ("flash2", "cudnn", "fa4")  # one kernel each: no mask or bias reaches them
_KEY = "model.attn_config"


@dataclasses.dataclass
class RopeDailConfig:
    """``attn_config.rope_dail_config``; only the plain rotary form is implemented."""

    type: Literal["original", "xpos"] = "original"
    pos_idx_in_fp32: bool = True
    xpos_scale_base: float = 512


@dataclasses.dataclass
class RopeHFConfig:
    """``attn_config.rope_hf_config``: HF's rotary scaling beyond the training length.

    ``linear`` divides positions by ``factor``; ``llama3`` rescales the frequencies as Llama 3.1 does
    (``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings`` are its keys).
    """

    type: Literal["no_scaling", "linear", "dynamic", "llama3"] = "no_scaling"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        key_path = f"{_KEY}.rope_hf_config"
        check_rope_scaling(self.type, self.factor, self.low_freq_factor, self.high_freq_factor, key_path)

    def inv_freq(self, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
        """The rotary frequencies (head_dim / 2,) in fp32, with this scaling applied."""
        inv_freq = rope_inv_freq(head_dim, theta, device)
        if self.type == "linear":  # the same as dividing positions by factor
            return inv_freq / self.factor
        if self.type == "llama3":
            original_length = self.original_max_position_embeddings
            return llama3_scaled_inv_freq(
                inv_freq, self.factor, self.low_freq_factor, self.high_freq_factor, original_length
            )
        return inv_freq


def check_rope_scaling(
    rope_type: str, factor: float, low_freq_factor: float, high_freq_factor: float, key_path: str
) -> None:
    """Scaling values that would give zero, infinite or reversed frequencies fail, naming ``key_path``."""
    if factor <= 0:
        raise ConfigError(f"'{key_path}.factor' is {factor}; it must be positive (1 = no scaling).")
    if rope_type == "llama3" and high_freq_factor <= low_freq_factor:
        raise ConfigError(
            f"'{key_path}.high_freq_factor' ({high_freq_factor}) must exceed '{key_path}.low_freq_factor' "
            f"({low_freq_factor}) for llama3 scaling (Llama 3.1 uses 4 and 1)."
        )


@dataclasses.dataclass
class AttnConfig:
    """``model.attn_config``, with LLM Foundry's keys and defaults except ``attn_impl``.

    LLM Foundry defaults to ``flash`` (the flash-attn package); ours is ``sdpa``, which runs
    FlashAttention on a GPU when it can and works everywhere else.
    """

    attn_type: AttnType = "multihead_attention"
    attn_impl: AttnImpl = "sdpa"
    attn_pdrop: float = 0.0
    kv_n_heads: int | None = None  # grouped_query_attention only; MHA uses n_heads, MQA 1
    head_dim: int | None = None  # None: d_model / n_heads; set where q is wider or narrower than d_model (Qwen3)
    qk_ln: bool = False  # LayerNorm over all of q and of k
    qk_gn: bool = False  # the same norm per head (shared weights of size head_dim)
    clip_qkv: float | None = None
    softmax_scale: float | None = None  # None: 1 / sqrt(head_dim)
    sliding_window_size: int = -1  # query i sees keys i - window .. i; -1: off
    alibi: bool = False
    alibi_bias_max: float = 8
    rope: bool = False
    rope_theta: float = 10000
    rope_impl: Literal["dail", "hf"] = "dail"
    rope_dail_config: RopeDailConfig = dataclasses.field(default_factory=RopeDailConfig)
    rope_hf_config: RopeHFConfig = dataclasses.field(default_factory=RopeHFConfig)
    attn_uses_sequence_id: bool = False
    prefix_lm: bool = False
    fused_qkv: bool = True
    attn_logit_softcapping: float | None = None
    kv_dim: int | None = None

    def __post_init__(self) -> None:
        self._check_not_yet_supported()
        if not 0.0 <= self.attn_pdrop <= 1.0:
            raise ConfigError(f"'{_KEY}.attn_pdrop' is {self.attn_pdrop}; it is a probability in [0, 1].")
        if self.qk_ln and self.qk_gn:
            raise ConfigError(f"'{_KEY}.qk_ln' and '{_KEY}.qk_gn' are both true; set at most one.")
        if self.head_dim is not None and self.head_dim <= 0:
            raise ConfigError(f"'{_KEY}.head_dim' is {self.head_dim}; it must be positive (null: d_model / n_heads).")
        if self.sliding_window_size < -1:
            raise ConfigError(f"'{_KEY}.sliding_window_size' is {self.sliding_window_size}; use -1 (off) or >= 0.")
        if self.attn_impl not in ATTENTION_IMPLS:
            raise ConfigError(
                f"'{_KEY}.attn_impl' is {self.attn_impl!r}; it must be one of {', '.join(map(repr, ATTENTION_IMPLS))} "
                "(or a kernel registered in foundry.models.attention.ATTENTION_IMPLS)."
                + did_you_mean(self.attn_impl, ATTENTION_IMPLS)
            )
        kernels_without_dropout = {"flex": "FlexAttention", "fa4": "FlashAttention-4"}
        if self.attn_impl in kernels_without_dropout and self.attn_pdrop > 0:
            raise ConfigError(
                f"'{_KEY}.attn_pdrop' is {self.attn_pdrop}, but {kernels_without_dropout[self.attn_impl]} (attn_impl "
                f"'{self.attn_impl}') has no attention dropout. Set attn_pdrop: 0, or use attn_impl 'sdpa'."
            )
        masked = {"alibi": self.alibi, "sliding_window_size": self.sliding_window_size != -1}
        masked["attn_uses_sequence_id"] = self.attn_uses_sequence_id
        if self.attn_impl in PINNED_IMPLS and any(masked.values()):
            feature = next(key for key, is_set in masked.items() if is_set)
            raise ConfigError(
                f"'{_KEY}.{feature}' needs an additive attention bias or mask, which SDPA's {self.attn_impl} backend "
                f"cannot take; set '{_KEY}.attn_impl' to 'sdpa' (or 'torch')."
            )

    def _check_not_yet_supported(self) -> None:
        """LLM Foundry values foundry does not implement fail here rather than being ignored."""
        unsupported = {
            "prefix_lm": (self.prefix_lm, "prefix-LM masking is not implemented; set it to false"),
            "fused_qkv": (not self.fused_qkv, "only the fused Wqkv projection exists; set it to true"),
            "attn_logit_softcapping": (self.attn_logit_softcapping is not None, "is not implemented; remove it"),
            "kv_dim": (self.kv_dim is not None, "(cross-attention) is not implemented; remove it"),
            "rope_dail_config.type": (self.rope_dail_config.type != "original", "'xpos' is not implemented"),
            "rope_dail_config.pos_idx_in_fp32": (not self.rope_dail_config.pos_idx_in_fp32, "must be true"),
            "rope_hf_config.type": (self.rope_hf_config.type == "dynamic", "'dynamic' is not implemented"),
            "rope_impl": (
                self.rope_impl == "dail" and self.rope_hf_config.type != "no_scaling",
                "'dail' with rope_hf_config scaling; set rope_impl: hf to use rope_hf_config",
            ),
        }
        for key, (is_set, fix) in unsupported.items():
            if is_set:
                raise ConfigError(f"'{_KEY}.{key}' is not supported by foundry {fix}.")

    def resolve_head_dim(self, d_model: int, n_heads: int) -> int:
        """Each head's width: ``head_dim``, else ``d_model / n_heads`` (which must then divide)."""
        if self.head_dim is not None:
            return self.head_dim
        if d_model % n_heads:
            raise ConfigError(
                f"'model.d_model' ({d_model}) must be divisible by 'model.n_heads' ({n_heads}): each head gets "
                f"d_model / n_heads dimensions, unless '{_KEY}.head_dim' sets the width."
            )
        return d_model // n_heads

    def resolve_kv_n_heads(self, n_heads: int) -> int:
        """How many key/value heads ``attn_type`` gives ``n_heads`` query heads."""
        if self.attn_type == "multiquery_attention":
            kv_n_heads = 1
        elif self.attn_type == "multihead_attention":
            kv_n_heads = n_heads
        elif self.kv_n_heads is None:
            raise ConfigError(f"'{_KEY}.attn_type' is grouped_query_attention; set '{_KEY}.kv_n_heads'.")
        else:
            kv_n_heads = self.kv_n_heads
        if self.kv_n_heads is not None and self.kv_n_heads != kv_n_heads:
            raise ConfigError(
                f"'{_KEY}.kv_n_heads' is {self.kv_n_heads} but {self.attn_type} uses {kv_n_heads}; "
                f"set '{_KEY}.attn_type: grouped_query_attention' to choose the number of key/value heads."
            )
        if not 0 < kv_n_heads <= n_heads or n_heads % kv_n_heads:
            raise ConfigError(f"'{_KEY}.kv_n_heads' ({kv_n_heads}) must divide 'model.n_heads' ({n_heads}).")
        return kv_n_heads


# ----------------------------------------------------------------------------- per-forward inputs


@dataclasses.dataclass
class AttentionInputs:
    """What all layers of one forward share; built once by ``build_attention_inputs``."""

    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin: (batch or 1, seq, 1, head_dim) fp32
    allowed: torch.Tensor | None = None  # (batch or 1, 1, seq, seq) bool, True = may attend; None = causal
    bias: torch.Tensor | None = None  # ALiBi, (1, n_heads, seq, seq) fp32
    past_len: int | torch.Tensor = 0  # tokens already in the KV cache (an int, or a 0-d device tensor)
    # Where FlexAttention runs, the masks above stay None and these say the same without seq² tensors:
    block_mask: BlockMask | None = None
    score_mod: ScoreMod | None = None  # ALiBi

    def causal_allowed(self, seq_len: int, device: torch.device) -> torch.Tensor:
        if self.allowed is not None:
            return self.allowed
        return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]


def build_attention_inputs(
    config: AttnConfig,
    n_heads: int,
    head_dim: int,
    seq_len: int,
    positions: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    sequence_id: torch.Tensor | None = None,
    past_len: int | torch.Tensor = 0,
) -> AttentionInputs:
    """Masks, ALiBi bias and RoPE angles for a batch.

    Args:
        positions: (batch or 1, seq) position of each token, used for RoPE.
        key_padding_mask: (batch, keys) bool, True = real token; None when there is no padding. The keys
            are the seq tokens, or with a KV cache all of its columns (the masks are then (seq, keys)).
        sequence_id: (batch, seq) index of the packed example each token belongs to (-1 = padding);
            a token then attends only to earlier tokens of its own example (document masking).
        past_len: with a KV cache, how many tokens it already holds (the first query's column); a 0-d
            device tensor keeps the masks free of host values (a decode step captured in a CUDA graph).
    """
    device = positions.device
    inputs = AttentionInputs(past_len=past_len)
    if config.rope:
        scaling = config.rope_hf_config if config.rope_impl == "hf" else RopeHFConfig()
        inputs.rope = rope_cos_sin(positions, scaling.inv_freq(head_dim, config.rope_theta, device))
    masked = config.alibi or config.sliding_window_size >= 0 or key_padding_mask is not None or sequence_id is not None
    cached = not isinstance(past_len, int) or past_len != 0 or key_len_of(key_padding_mask, seq_len) != seq_len
    if _runs_flex(config, masked, device, head_dim, cached):
        inputs.block_mask = block_mask(seq_len, config.sliding_window_size, sequence_id, key_padding_mask, device)
        if config.alibi:
            inputs.score_mod = alibi_score_mod(alibi_slopes(n_heads, config.alibi_bias_max, device))
        return inputs
    key_len = key_len_of(key_padding_mask, seq_len)
    query_pos = (past_len + torch.arange(seq_len, device=device))[:, None]
    distance = query_pos - torch.arange(key_len, device=device)[None, :]  # (seq, keys): i - j
    if config.alibi:
        inputs.bias = (-distance.float() * alibi_slopes(n_heads, config.alibi_bias_max, device)[:, None, None])[None]
    if config.alibi or config.sliding_window_size >= 0 or key_padding_mask is not None or sequence_id is not None:
        allowed = distance >= 0
        if config.sliding_window_size >= 0:
            allowed &= distance <= config.sliding_window_size
        allowed = allowed[None, None]
        if sequence_id is not None:  # block-diagonal: (batch, 1, seq, seq); ALiBi's i - j is the same in a block
            allowed = allowed & (sequence_id[:, None, :, None] == sequence_id[:, None, None, :])
        if key_padding_mask is not None:
            # A padding query may see itself, so no row is all-masked (a NaN that would leak into
            # real tokens through 0 * NaN); its output is never used.
            diagonal = distance == 0
            allowed = (allowed & key_padding_mask[:, None, None, :].bool()) | diagonal
        inputs.allowed = allowed
    return inputs


# ----------------------------------------------------------------------------- kernels
# Each takes q (batch, n_heads, seq, head_dim), k and v (batch, kv_n_heads, seq, head_dim)
# and returns (batch, n_heads, seq, head_dim) in q's dtype.


def key_len_of(key_padding_mask: torch.Tensor | None, seq_len: int) -> int:
    """How many keys attention sees: the seq tokens, or with a KV cache every column of the cache."""
    return seq_len if key_padding_mask is None else key_padding_mask.shape[1]


def _runs_flex(config: AttnConfig, masked: bool, device: torch.device, head_dim: int, cached: bool) -> bool:
    """FlexAttention for ``flex``, and for ``flash`` when a mask or bias is needed; on a GPU, without a KV cache."""
    wants_flex = config.attn_impl == "flex" or (config.attn_impl == "flash" and masked and config.attn_pdrop == 0)
    if not wants_flex or cached:
        return False
    if flex_runs_on(device, head_dim):
        return True
    if config.attn_impl == "flex":
        reason = f"no backward on {device.type}" if device.type != "cuda" else f"no kernel for {head_dim}-wide heads"
        _warn_once(
            f"'{_KEY}.attn_impl' is 'flex', but FlexAttention has {reason}; attention runs on SDPA with dense "
            "masks here (the same function, slower and O(seq²) in memory)."
        )
    return False


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def repeat_kv(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(batch, kv_heads, seq, d) -> (batch, n_heads, seq, d); kv head g serves query heads g*r .. g*r+r-1."""
    return x.repeat_interleave(n_heads // x.shape[1], dim=1) if x.shape[1] != n_heads else x


def torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, scale: float, dropout_p: float
) -> torch.Tensor:
    """The explicit math in fp32 (autocast off): the reference the fast kernels are tested against."""
    n_heads, seq_len = q.shape[1], q.shape[2]
    with torch.autocast(q.device.type, enabled=False):
        k, v = repeat_kv(k.float(), n_heads), repeat_kv(v.float(), n_heads)
        scores = q.float() @ k.transpose(-2, -1) * scale  # (batch, n_heads, seq, seq)
        if inputs.bias is not None:
            scores = scores + inputs.bias
        scores = scores.masked_fill(~inputs.causal_allowed(seq_len, q.device), float("-inf"))
        probs = F.dropout(scores.softmax(dim=-1), p=dropout_p)
        return (probs @ v).to(q.dtype)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, scale: float, dropout_p: float
) -> torch.Tensor:
    mask = None
    if inputs.bias is not None:  # ALiBi is additive; SDPA wants it in q's dtype
        mask = inputs.bias.to(q.dtype).masked_fill(~inputs.causal_allowed(q.shape[2], q.device), float("-inf"))
    elif inputs.allowed is not None:
        mask = inputs.allowed
    if mask is not None:  # enable_gqa keeps SDPA off the mask-capable efficient backend; expand instead
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None, scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )  # fmt: skip


# SDPA's fused backends: flash-class kernels that never materialise the (seq, seq) scores.
FUSED_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def fused_sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, scale: float, dropout_p: float
) -> torch.Tensor:
    """FlexAttention where the inputs carry a block mask, else FlashAttention-4 where it runs, else SDPA fused."""
    if inputs.block_mask is not None:
        return flex_attention_fn(q, k, v, inputs.block_mask, inputs.score_mod, scale)
    if _plain_causal(inputs, dropout_p) and not _flash_attention4_unsupported(q, k):
        return flash_attention4.flash_attention4(q, k, v, scale)
    try:
        with sdpa_kernel(FUSED_BACKENDS):
            return sdpa_attention(q, k, v, inputs, scale, dropout_p)
    except RuntimeError as error:
        if not any(text in str(error) for text in ("No available kernel", "No viable backend")):
            raise
        raise ConfigError(
            f"'{_KEY}.attn_impl' is 'flash', but no fused attention kernel of this torch can run this input "
            f"(q {tuple(q.shape)}, {q.dtype} on {q.device.type}, mask: {inputs.allowed is not None}): {error} "
            "Use attn_impl 'sdpa', which may fall back to the unfused math."
        ) from error


def _plain_causal(inputs: AttentionInputs, dropout_p: float) -> bool:
    return inputs.allowed is None and inputs.bias is None and dropout_p == 0


def _flash_attention4_unsupported(q: torch.Tensor, k: torch.Tensor) -> str:
    """Why FlashAttention-4 cannot take q's device, dtype and (batch, heads, seq, head_dim) shape; '' when it can."""
    index = q.device.index or 0
    return flash_attention4.unsupported_reason(q.device.type, index, q.dtype, q.shape[-1], q.shape[1], k.shape[1])


def flash_attention4_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, scale: float, dropout_p: float
) -> torch.Tensor:
    """Exactly FlashAttention-4: fails with the reason rather than run another kernel."""
    _require_flash_attention4(q, k, _plain_causal(inputs, dropout_p))
    return flash_attention4.flash_attention4(q, k, v, scale)


def _require_flash_attention4(q: torch.Tensor, k: torch.Tensor, plain_causal: bool) -> None:
    """``fa4`` pinned: a ConfigError naming why FlashAttention-4 cannot run this input."""
    reason = _flash_attention4_unsupported(q, k)
    if not reason and not plain_causal:
        reason = "it takes plain causal attention only, and this forward has padding or attention dropout"
    if reason:
        raise ConfigError(
            f"'{_KEY}.attn_impl' is 'fa4', but FlashAttention-4 cannot run here: {reason}. Use attn_impl 'flash', "
            "which runs FlashAttention-4 where it can and the fastest other fused kernel elsewhere."
        )


def flex_or_sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, scale: float, dropout_p: float
) -> torch.Tensor:
    """``flex``: FlexAttention (block mask from ``build_attention_inputs``), or SDPA where it cannot run."""
    if inputs.block_mask is not None:
        return flex_attention_fn(q, k, v, inputs.block_mask, inputs.score_mod, scale)
    return sdpa_attention(q, k, v, inputs, scale, dropout_p)


# Decoding calls attention once per layer per new token. cuDNN spends about 0.26 ms of host time
# setting up each masked call (H100, docs/PERFORMANCE.md), which bounds decoding by the host; the
# other backends take the mask without that setup.
_DECODING_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def cached_sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, scale: float, dropout_p: float
) -> torch.Tensor:
    """``sdpa_attention`` for KV-cached decoding: any backend but cuDNN."""
    with sdpa_kernel(_DECODING_BACKENDS):
        return sdpa_attention(q, k, v, inputs, scale, dropout_p)


def _pinned_sdpa(
    backend: SDPBackend, impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs,
    scale: float, dropout_p: float,
) -> torch.Tensor:  # fmt: skip
    """SDPA restricted to one fused backend: fails loudly instead of falling back to a slower one."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        raise ConfigError(
            f"'{_KEY}.attn_impl' is '{impl}', which needs a CUDA GPU and fp16/bf16 activations "
            f"(precision: amp_bf16); this forward ran on {q.device.type} in {q.dtype}. Use attn_impl 'sdpa'."
        )
    if inputs.allowed is not None or inputs.bias is not None:
        raise ConfigError(
            f"'{_KEY}.attn_impl' is '{impl}', which cannot mask padding or packed examples, but this batch's "
            f"attention_mask has padding. Use attn_impl 'sdpa', or feed unpadded batches."
        )
    if backend == SDPBackend.CUDNN_ATTENTION:  # cuDNN takes equal head counts only
        k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
    try:
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
            )
    except RuntimeError as error:
        raise ConfigError(
            f"'{_KEY}.attn_impl' is '{impl}' but that backend cannot run this input (q {tuple(q.shape)}, kv heads "
            f"{k.shape[1]}, {q.dtype}, {torch.cuda.get_device_name(q.device)}): {error} Use 'sdpa'."
        ) from error


def flash2_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, scale: float, dropout_p: float
) -> torch.Tensor:
    """SDPA pinned to FlashAttention-2."""
    return _pinned_sdpa(SDPBackend.FLASH_ATTENTION, "flash2", q, k, v, inputs, scale, dropout_p)


def cudnn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: AttentionInputs, scale: float, dropout_p: float
) -> torch.Tensor:
    """SDPA pinned to cuDNN's fused attention (fastest on Hopper for head_dim 128)."""
    return _pinned_sdpa(SDPBackend.CUDNN_ATTENTION, "cudnn", q, k, v, inputs, scale, dropout_p)


AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionInputs, float, float], torch.Tensor]
ATTENTION_IMPLS: dict[str, AttentionFn] = {
    "sdpa": sdpa_attention,
    "flash": fused_sdpa_attention,
    "flash2": flash2_attention,
    "cudnn": cudnn_attention,
    "fa4": flash_attention4_attention,
    "flex": flex_or_sdpa_attention,
    "torch": torch_attention,
}


# ----------------------------------------------------------------------------- module


def mask_beyond_causal(config: AttnConfig) -> str | None:
    """Which of ``config``'s keys needs a mask beyond causal (ALiBi's bias counts), or None."""
    for key, on in (
        ("alibi", config.alibi),
        ("attn_uses_sequence_id", config.attn_uses_sequence_id),
        ("sliding_window_size", config.sliding_window_size >= 0),
    ):
        if on:
            return key
    return None


class Attention(nn.Module):
    """Causal self-attention with a fused Wqkv projection (LLM Foundry's GroupedQueryAttention).

    Parameter names (``Wqkv``, ``out_proj``, ``q_ln``, ``k_ln``) match LLM Foundry's, so checkpoints map 1:1.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        config: AttnConfig,
        norm_type: NormType = "low_precision_layernorm",
        norm_eps: float = 1e-5,
        bias: bool = True,
    ) -> None:
        super().__init__()
        self.config = config
        self.n_heads = n_heads
        self.kv_n_heads = config.resolve_kv_n_heads(n_heads)
        self.head_dim = config.resolve_head_dim(d_model, n_heads)
        self.softmax_scale = 1 / math.sqrt(self.head_dim) if config.softmax_scale is None else config.softmax_scale
        self.attn_fn = ATTENTION_IMPLS[config.attn_impl]
        # A KV cache's keys always need a mask (left padding, columns not yet written): only these take one.
        self.cached_attn_fn = torch_attention if config.attn_impl == "torch" else cached_sdpa_attention
        q_dim, kv_dim = n_heads * self.head_dim, self.kv_n_heads * self.head_dim  # q_dim is d_model unless head_dim
        self.Wqkv = nn.Linear(d_model, q_dim + 2 * kv_dim, bias=bias)
        self.Wqkv.init_chunk_rows = self.head_dim  # init.py inits each head's slice as its own matrix
        if config.qk_ln or config.qk_gn:
            self.q_ln = build_norm(norm_type, self.head_dim if config.qk_gn else q_dim, norm_eps, bias)
            self.k_ln = build_norm(norm_type, self.head_dim if config.qk_gn else kv_dim, norm_eps, bias)
        self.out_proj = nn.Linear(q_dim, d_model, bias=bias)
        self.out_proj.is_residual_output = True  # init.py scales it down by depth
        self.apply_rope = apply_rope  # the fused_kernels algorithm swaps in its Triton kernel

    def forward(self, x: torch.Tensor, inputs: AttentionInputs, cache: LayerKVCache | None = None) -> torch.Tensor:
        """``cache``: this layer's KV cache; x's keys and values are stored at column ``inputs.past_len``."""
        batch, seq_len, _ = x.shape
        qkv = self.Wqkv(x)  # (batch, seq, q_dim + 2 * kv_dim), divided by the tensor-parallel degree
        if self.config.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.config.clip_qkv, max=self.config.clip_qkv)
        # Under tensor parallelism this rank holds 1/shares of the heads (foundry.models.tp_plan)
        shares = self.Wqkv.out_features // qkv.shape[-1]
        q_dim, kv_dim = self.n_heads * self.head_dim // shares, self.kv_n_heads * self.head_dim // shares
        q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
        q = q.reshape(batch, seq_len, -1, self.head_dim)
        k = k.reshape(batch, seq_len, -1, self.head_dim)
        v = v.reshape(batch, seq_len, -1, self.head_dim)
        if self.config.qk_ln or self.config.qk_gn:
            q, k = self._qk_norm(q, self.q_ln), self._qk_norm(k, self.k_ln)
        if inputs.rope is not None:
            q, k = self.apply_rope(q, *inputs.rope), self.apply_rope(k, *inputs.rope)
        dropout_p = self.config.attn_pdrop if self.training else 0.0
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (batch, heads, seq, head_dim)
        if cache is None:
            out = self.attn_fn(q, k, v, inputs, self.softmax_scale, dropout_p)
        else:
            k, v = cache.write(k, v, inputs.past_len)  # (batch, kv_heads, max_len, head_dim)
            out = self.cached_attn_fn(q, k, v, inputs, self.softmax_scale, dropout_p)
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq_len, q_dim))

    def runs_flash_attention4(self, q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> bool:
        """Whether this layer's kernel runs plain causal attention of q and k (batch, heads, seq, head_dim) on
        FlashAttention-4: ``flash`` where it can, ``fa4`` always (a ConfigError where it cannot).

        Context parallelism asks, so that its sequence chunks run on the kernel the layer would run.
        """
        kernel = ATTENTION_IMPLS[self.config.attn_impl]
        if kernel is flash_attention4_attention:
            _require_flash_attention4(q, k, dropout_p == 0)
            return True
        return kernel is fused_sdpa_attention and dropout_p == 0 and not _flash_attention4_unsupported(q, k)

    def mask_beyond_causal(self) -> str | None:
        """The ``attn_config`` key that gives this layer a mask beyond causal, or None (context parallelism asks)."""
        return mask_beyond_causal(self.config)

    def _qk_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """qk_ln normalises all heads together, qk_gn each head; x is (batch, seq, heads, head_dim)."""
        if self.config.qk_gn:
            return norm(x).to(x.dtype)
        return norm(x.flatten(2)).to(x.dtype).view_as(x)
