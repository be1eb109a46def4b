"""foundry's MPT for ``transformers``, written into an export that no built-in class computes exactly.

``foundry convert to-hf`` copies this file, unchanged, beside the weights of an MPT whose settings no
built-in transformers class reproduces (grouped-query attention, QK norm, GLU, RMSNorm with ALiBi, a
logit scale, ...); ``config.json`` names it in ``auto_map``, so the folder loads with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``. It imports only torch and
transformers. Config keys and parameter names are foundry's (LLM Foundry's MPT keys), and every forward
computes what ``foundry.models.mpt`` computes; ``tests/convert/test_export_yamls.py`` compares the two on each
setting it exports with this code (``SETTINGS``), so they cannot drift apart. Works with transformers 4.57 and 5.x.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

# transformers 5 calls the KV cache `cache`, 4.x `past_key_values` (argument and output field alike).
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class FoundryMPTConfig(PretrainedConfig):
    """foundry's ``mpt_causal_lm`` model section; every key the forward reads is written by the export."""

    model_type = "foundry_mpt"
    attribute_map = {"hidden_size": "d_model", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers"}

    def __init__(
        self,
        d_model: int = 2048,
        n_heads: int = 16,
        n_layers: int = 24,
        expansion_ratio: float = 4,
        max_seq_len: int = 2048,
        vocab_size: int = 50368,
        resid_pdrop: float = 0.0,
        emb_pdrop: float = 0.0,
        learned_pos_emb: bool = True,
        attn_config: dict[str, Any] | None = None,
        ffn_config: dict[str, Any] | None = None,
        logit_scale: float | str | None = None,
        no_bias: bool = False,
        norm_type: str = "low_precision_layernorm",
        norm_eps: float = 1e-5,
        tie_word_embeddings: bool = True,
        **kwargs: Any,
    ) -> None:
        self.d_model, self.n_heads, self.n_layers = d_model, n_heads, n_layers
        self.expansion_ratio, self.max_seq_len, self.vocab_size = expansion_ratio, max_seq_len, vocab_size
        self.resid_pdrop, self.emb_pdrop, self.learned_pos_emb = resid_pdrop, emb_pdrop, learned_pos_emb
        self.attn_config = dict(attn_config or {})
        self.ffn_config = dict(ffn_config or {})
        self.logit_scale, self.no_bias, self.norm_type, self.norm_eps = logit_scale, no_bias, norm_type, norm_eps
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)


# ----------------------------------------------------------------------------- layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def build_norm(config: FoundryMPTConfig, dim: int) -> nn.Module:
    if "rmsnorm" in config.norm_type:
        return RMSNorm(dim, config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=not config.no_bias)


def ffn_hidden_size(config: FoundryMPTConfig) -> int:
    return config.ffn_config.get("ffn_hidden_size") or int(config.d_model * config.expansion_ratio)


class FeedForward(nn.Module):
    """``down(act(up(x)))`` (mptmlp) or ``down(act(gate(x)) * up(x))`` (mptglu)."""

    def __init__(self, config: FoundryMPTConfig) -> None:
        super().__init__()
        hidden, bias = ffn_hidden_size(config), not config.no_bias
        act = config.ffn_config.get("ffn_act_fn") or {}
        self.act_name, self.act_approximate = act.get("name", "gelu"), act.get("approximate", "none")
        self.up_proj = nn.Linear(config.d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, config.d_model, bias=bias)
        is_glu = config.ffn_config.get("ffn_type", "mptmlp") == "mptglu"
        self.gate_proj = nn.Linear(config.d_model, hidden, bias=bias) if is_glu else None

    def act(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_name == "gelu":
            return F.gelu(x, approximate=self.act_approximate)
        return F.silu(x) if self.act_name == "silu" else F.relu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def kv_heads(config: FoundryMPTConfig) -> int:
    attn_type = config.attn_config.get("attn_type", "multihead_attention")
    if attn_type == "multiquery_attention":
        return 1
    if attn_type == "grouped_query_attention":
        return config.attn_config["kv_n_heads"]
    return config.n_heads


def rope_inv_freq(config: FoundryMPTConfig, head_dim: int, device: torch.device) -> torch.Tensor:
    """theta^(-2i / head_dim), with rope_hf_config's linear or llama3 scaling under rope_impl hf."""
    attn = config.attn_config
    inv_freq = 1.0 / attn.get("rope_theta", 10000) ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    scaling = (attn.get("rope_hf_config") or {}) if attn.get("rope_impl", "dail") == "hf" else {}
    kind, factor = scaling.get("type", "no_scaling"), scaling.get("factor", 1.0)
    if kind == "linear":
        return inv_freq / factor
    if kind != "llama3":
        return inv_freq
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling.get("original_max_position_embeddings", 8192)
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    is_medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(is_medium, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotation of x (batch, seq, heads, head_dim), in fp32."""
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat([-second, first], dim=-1) * sin).to(x.dtype)


def alibi_slopes(n_heads: int, alibi_bias_max: float, device: torch.device) -> torch.Tensor:
    padded_heads = 2 ** math.ceil(math.log2(n_heads))
    exponents = torch.arange(1, padded_heads + 1, dtype=torch.float32, device=device) * (alibi_bias_max / padded_heads)
    slopes = 1.0 / torch.pow(2, exponents)
    if padded_heads != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes


class Attention(nn.Module):
    """Causal self-attention with a fused Wqkv projection (rows q, k, v), GQA/MQA, QK norm and clipping."""

    def __init__(self, config: FoundryMPTConfig, layer_idx: int) -> None:
        super().__init__()
        attn, bias = config.attn_config, not config.no_bias
        self.layer_idx, self.n_heads, self.kv_n_heads = layer_idx, config.n_heads, kv_heads(config)
        self.head_dim = config.d_model // config.n_heads
        scale = attn.get("softmax_scale")
        self.softmax_scale = 1 / math.sqrt(self.head_dim) if scale is None else scale
        self.clip_qkv, self.attn_pdrop = attn.get("clip_qkv"), attn.get("attn_pdrop", 0.0)
        self.qk_gn = attn.get("qk_gn", False)
        kv_dim = self.kv_n_heads * self.head_dim
        self.Wqkv = nn.Linear(config.d_model, config.d_model + 2 * kv_dim, bias=bias)
        if attn.get("qk_ln") or self.qk_gn:
            self.q_ln = build_norm(config, self.head_dim if self.qk_gn else config.d_model)
            self.k_ln = build_norm(config, self.head_dim if self.qk_gn else kv_dim)
        self.out_proj = nn.Linear(config.d_model, config.d_model, bias=bias)

    def _qk_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return norm(x).to(x.dtype) if self.qk_gn else norm(x.flatten(2)).to(x.dtype).view_as(x)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: tuple | None, cache: Cache | None) -> torch.Tensor:
        batch, seq_len, d_model = x.shape
        qkv = self.Wqkv(x)
        if self.clip_qkv is not None:
            qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
        kv_dim = self.kv_n_heads * self.head_dim
        q, k, v = qkv.split([d_model, kv_dim, kv_dim], dim=-1)
        q = q.reshape(batch, seq_len, self.n_heads, self.head_dim)
        k = k.reshape(batch, seq_len, self.kv_n_heads, self.head_dim)
        v = v.reshape(batch, seq_len, self.kv_n_heads, self.head_dim)
        if hasattr(self, "q_ln"):
            q, k = self._qk_norm(q, self.q_ln), self._qk_norm(k, self.k_ln)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (batch, heads, seq, head_dim)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        repeat = self.n_heads // self.kv_n_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        dropout_p = self.attn_pdrop if self.training else 0.0
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.to(q.dtype), dropout_p=dropout_p, scale=self.softmax_scale
        )
        return self.out_proj(out.transpose(1, 2).reshape(batch, seq_len, d_model))


class Block(nn.Module):
    def __init__(self, config: FoundryMPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.norm_1 = build_norm(config, config.d_model)
        self.attn = Attention(config, layer_idx)
        self.norm_2 = build_norm(config, config.d_model)
        self.ffn = FeedForward(config)
        self.resid_attn_dropout = nn.Dropout(config.resid_pdrop)
        self.resid_ffn_dropout = nn.Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, rope: tuple | None, cache: Cache | None) -> torch.Tensor:
        x = x + self.resid_attn_dropout(self.attn(self.norm_1(x), mask, rope, cache))
        return x + self.resid_ffn_dropout(self.ffn(self.norm_2(x)))


class Transformer(nn.Module):
    """Token ids -> hidden states; parameter names as foundry's (``wte``, ``wpe``, ``blocks``, ``norm_f``)."""

    def __init__(self, config: FoundryMPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.max_seq_len, config.d_model) if config.learned_pos_emb else None
        self.emb_drop = nn.Dropout(config.emb_pdrop)
        self.blocks = nn.ModuleList(Block(config, index) for index in range(config.n_layers))
        self.norm_f = build_norm(config, config.d_model)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None
    ) -> torch.Tensor:
        """``input_ids`` (batch, new) follow the cache's tokens; ``attention_mask`` (batch, cached + new) marks
        left padding. Positions skip each row's padding (learned and rope_impl hf) as foundry's do."""
        attn, device = self.config.attn_config, input_ids.device
        past_len = cache.get_seq_length() if cache is not None else 0
        batch, seq_len = input_ids.shape
        key_len = past_len + seq_len
        real = torch.ones(batch, key_len, dtype=torch.bool, device=device)
        if attention_mask is not None:
            real = attention_mask[:, -key_len:].bool()
        columns = past_len + torch.arange(seq_len, device=device)  # (new,)
        shifted = (columns - (~real).cumsum(dim=1)[:, columns]).clamp(min=0)  # (batch, new)
        x = self._embed(input_ids, shifted)
        mask = self._additive_mask(columns, real)
        rope = self._rope(shifted if attn.get("rope_impl", "dail") == "hf" else columns[None])
        for block in self.blocks:
            x = block(x, mask, rope, cache)
        return self.norm_f(x)

    def _additive_mask(self, columns: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """(batch, 1 or heads, new, keys): ALiBi's bias where a query may attend (causal, in the window, a real
        key), -inf elsewhere; a padding query sees itself, so no row is all -inf."""
        attn, device = self.config.attn_config, columns.device
        distance = columns[:, None] - torch.arange(real.shape[1], device=device)[None, :]  # (new, keys): i - j
        allowed = distance >= 0
        window = attn.get("sliding_window_size", -1)
        if window >= 0:
            allowed &= distance <= window
        allowed = (allowed[None] & real[:, None, :]) | (distance == 0)[None]
        bias = torch.zeros(distance.shape, device=device)[None, None]
        if attn.get("alibi"):
            slopes = alibi_slopes(self.config.n_heads, attn.get("alibi_bias_max", 8), device)
            bias = (-distance.float() * slopes[:, None, None])[None]
        return bias.masked_fill(~allowed[:, None], float("-inf"))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin of the rotary angles at ``positions`` (batch or 1, new), each (batch or 1, new, 1, head_dim)."""
        if not self.config.attn_config.get("rope"):
            return None
        inv_freq = rope_inv_freq(self.config, self.config.d_model // self.config.n_heads, positions.device)
        angles = positions.float()[..., None] * inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
        return angles.cos(), angles.sin()

    def _embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token (+ learned position) embeddings, (batch, seq, d_model)."""
        x = self.wte(input_ids)
        if self.wpe is not None:
            x = x + self.wpe(positions)
        return self.emb_drop(x)


# ----------------------------------------------------------------------------- transformers models


class FoundryMPTPreTrainedModel(PreTrainedModel):
    config_class = FoundryMPTConfig
    base_model_prefix = "transformer"
    _no_split_modules = ["Block"]

    def _init_weights(self, module: nn.Module) -> None:
        """Only weights missing from a checkpoint are initialised (N(0, 0.02), norms to one)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)


class FoundryMPTForCausalLM(FoundryMPTPreTrainedModel, GenerationMixin):
    """Logits (batch, seq, vocab); the output head is the token embedding itself when tied."""

    def __init__(self, config: FoundryMPTConfig) -> None:
        super().__init__(config)
        self.transformer = Transformer(config)
        tied = config.tie_word_embeddings
        self.lm_head = None if tied else nn.Linear(config.d_model, config.vocab_size, bias=False)
        scale = config.logit_scale
        self.logit_scale = 1 / math.sqrt(config.d_model) if scale == "inv_sqrt_d_model" else scale
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.transformer.wte = value

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if use_cache and cache is None:
            cache = DynamicCache()
        hidden = self.transformer(input_ids, attention_mask, cache)
        weight = self.transformer.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)  # (batch, seq, vocab)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})
