"""Layers every decoder-only family shares: norms, feed-forward networks and positional encodings.

Semantics follow LLM Foundry (``llmfoundry/models/layers/{norm,ffn}.py`` and the rotary/ALiBi code
of ``attention.py``) so that its YAMLs and checkpoints mean the same thing here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from foundry.core.precision import autocast_dtype
from foundry.errors import ConfigError

NormType = Literal["layernorm", "low_precision_layernorm", "rmsnorm", "low_precision_rmsnorm"]


# ----------------------------------------------------------------------------- norms


class LowPrecisionLayerNorm(nn.LayerNorm):
    """LayerNorm that runs in the autocast dtype instead of fp32 (LLM Foundry's LPLayerNorm).

    Autocast runs ``layer_norm`` in fp32; MPT trains with it in bf16 to save memory bandwidth.
    Outside autocast it is a plain LayerNorm.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(x.device.type)
        if dtype is None:
            return super().forward(x)
        weight = self.weight.to(dtype) if self.weight is not None else None
        bias = self.bias.to(dtype) if self.bias is not None else None
        with torch.autocast(x.device.type, enabled=False):
            return F.layer_norm(x.to(dtype), self.normalized_shape, weight, bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 and cast back to the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x.float(), self.weight).to(x.dtype)


class LowPrecisionRMSNorm(RMSNorm):
    """RMSNorm in the autocast dtype (LLM Foundry's LPRMSNorm); fp32 outside autocast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = autocast_dtype(x.device.type)
        if dtype is None:
            return super().forward(x)
        with torch.autocast(x.device.type, enabled=False):
            return self._norm(x.to(dtype), self.weight.to(dtype)).to(x.dtype)


def build_norm(norm_type: NormType, dim: int, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """A norm over the last ``dim`` features; ``bias`` applies to the LayerNorms only."""
    if norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=eps, bias=bias)
    if norm_type == "low_precision_layernorm":
        return LowPrecisionLayerNorm(dim, eps=eps, bias=bias)
    if norm_type == "rmsnorm":
        return RMSNorm(dim, eps=eps)
    if norm_type == "low_precision_rmsnorm":
        return LowPrecisionRMSNorm(dim, eps=eps)
    raise ConfigError(f"Unknown norm_type {norm_type!r}; use one of {', '.join(NormType.__args__)}.")


# ----------------------------------------------------------------------------- feed-forward


@dataclasses.dataclass
class ActFnConfig:
    """``ffn_config.ffn_act_fn``: a ``torch.nn.functional`` activation by name."""

    name: Literal["gelu", "silu", "relu"] = "gelu"
    approximate: Literal["none", "tanh"] = "none"

    def __post_init__(self) -> None:
        if self.approximate != "none" and self.name != "gelu":
            raise ConfigError(
                f"'model.ffn_config.ffn_act_fn.approximate' is {self.approximate!r} but only gelu has an "
                f"approximate form; remove it for {self.name!r}."
            )


def activation(act: ActFnConfig) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ``torch.nn.functional`` function ``act`` names: one lookup for the dense and the expert layers."""
    if act.name == "gelu":
        return functools.partial(F.gelu, approximate=act.approximate)
    return F.silu if act.name == "silu" else F.relu


MOE_FFN_TYPES = ("mb_moe", "mb_dmoe")


def check_moe_keys(num_experts: int, top_k: int, normalize_expert_weights: float | None, prefix: str) -> None:
    """A mixture of experts' routing keys, named as the YAML spells them: ``prefix`` + ``moe_num_experts`` etc.
    (``model.`` for a Llama, ``model.ffn_config.`` for an MPT)."""
    if num_experts < 1:
        raise ConfigError(
            f"'{prefix}moe_num_experts' is {num_experts}; a mixture of experts needs at least 1 expert per layer "
            "(8 or 16 are common)."
        )
    if not 1 <= top_k <= num_experts:
        raise ConfigError(
            f"'{prefix}moe_top_k' is {top_k}, but each token goes to between 1 and '{prefix}moe_num_experts' "
            f"({num_experts}) experts. Set moe_top_k to a number in 1..{num_experts} (2 is common)."
        )
    if normalize_expert_weights is not None and normalize_expert_weights <= 0:
        raise ConfigError(
            f"'{prefix}moe_normalize_expert_weights' is {normalize_expert_weights}: the top-k weights are divided by "
            "their p-norm, and p must be positive (1: weights sum to 1), or null for none."
        )


@dataclasses.dataclass
class FFNConfig:
    """``model.ffn_config``: LLM Foundry's feed-forward types, dense and mixture of experts.

    ``mb_moe`` and ``mb_dmoe`` (MegaBlocks' names) both build foundry's dropless MoE
    (``foundry.models.moe``), each expert ``ffn_hidden_size`` (or d_model * expansion_ratio) wide. The
    ``moe_*`` keys and defaults are MegaBlocks' ``Arguments``; keys that choose MegaBlocks kernels
    (``mlp_impl``, ``memory_optimized_mlp``) are accepted and have no effect, as foundry has one kernel path.
    """

    ffn_type: Literal["mptmlp", "mptglu", "mb_moe", "mb_dmoe"] = "mptmlp"
    ffn_act_fn: ActFnConfig | None = None  # None: exact gelu, and MegaBlocks' tanh gelu for the MoE types
    ffn_hidden_size: int | None = None  # overrides d_model * expansion_ratio
    moe_num_experts: int = 1
    moe_top_k: int = 1
    moe_loss_weight: float = 0.1  # the load-balancing loss's weight (foundry.models.moe)
    moe_zloss_weight: float = 0.0  # the router z-loss's weight
    moe_normalize_expert_weights: float | None = None  # p: top-k weights divided by their p-norm
    moe_jitter_eps: float | None = None
    moe_lbl_in_fp32: bool = False  # the loss terms are always computed in fp32 here
    moe_zloss_in_fp32: bool = False
    moe_capacity_factor: float = 1  # mb_moe's token dropping; foundry computes every token (dropless)
    moe_world_size: int = 1  # expert parallelism is set in the distributed section, not here
    mlp_type: Literal["mlp", "glu"] = "mlp"
    mlp_impl: Literal["sparse", "grouped"] = "sparse"
    memory_optimized_mlp: bool = False
    uniform_expert_assignment: bool = False
    shared_expert: bool = False
    shared_expert_hidden_size: int | None = None  # None: ffn_hidden_size
    moe_weight_parallelism: bool = False
    return_bias: bool = False

    def __post_init__(self) -> None:
        if self.ffn_act_fn is None:
            self.ffn_act_fn = ActFnConfig(approximate="tanh") if self.is_moe else ActFnConfig()
        if self.moe_world_size != 1:
            raise ConfigError(
                f"'model.ffn_config.moe_world_size' is {self.moe_world_size}; foundry sets expert parallelism in "
                "the distributed section (docs/MODELS.md, Mixture of experts). Remove the key or set it to 1."
            )
        if self.is_moe:
            check_moe_keys(self.moe_num_experts, self.moe_top_k, self.moe_normalize_expert_weights, "model.ffn_config.")
        if self.moe_weight_parallelism or self.return_bias:
            raise ConfigError(
                "'model.ffn_config.moe_weight_parallelism' and 'return_bias' are MegaBlocks options foundry does not "
                "have; remove them (the MoE output bias is added inside the layer)."
            )

    @property
    def is_moe(self) -> bool:
        return self.ffn_type in MOE_FFN_TYPES


def ffn_hidden_size(d_model: int, expansion_ratio: float, config: FFNConfig) -> int:
    """``ffn_hidden_size`` if set, else ``d_model * expansion_ratio``, which must be a whole number."""
    if config.ffn_hidden_size is not None:
        return config.ffn_hidden_size
    hidden = d_model * expansion_ratio
    if not float(hidden).is_integer():
        raise ConfigError(
            f"'model.d_model' * 'model.expansion_ratio' = {d_model} * {expansion_ratio} = {hidden} is not a "
            f"whole number; change expansion_ratio or set 'model.ffn_config.ffn_hidden_size'."
        )
    return int(hidden)


class MLP(nn.Module):
    """``down(act(up(x)))``: LLM Foundry's ``mptmlp``."""

    def __init__(self, d_model: int, hidden: int, act: ActFnConfig, bias: bool = True) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)
        self.down_proj.is_residual_output = True  # init.py scales it down by depth
        self.act_name, self.act_approximate = act.name, act.approximate  # what fused_kernels' GLU kernel reads
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GLU(MLP):
    """``down(act(gate(x)) * up(x))``: LLM Foundry's ``mptglu`` (SwiGLU with ``silu``)."""

    def __init__(self, d_model: int, hidden: int, act: ActFnConfig, bias: bool = True) -> None:
        super().__init__(d_model, hidden, act, bias)
        self.gate_proj = nn.Linear(d_model, hidden, bias=bias)

    def gated_act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``act(gate) * up``; the fused_kernels algorithm replaces it with one Triton kernel."""
        return self.act(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated_act(self.gate_proj(x), self.up_proj(x)))


def build_ffn(config: FFNConfig, d_model: int, expansion_ratio: float, bias: bool = True) -> MLP:
    hidden = ffn_hidden_size(d_model, expansion_ratio, config)
    ffn_class = GLU if config.ffn_type == "mptglu" else MLP
    return ffn_class(d_model, hidden, config.ffn_act_fn, bias=bias)


# ----------------------------------------------------------------------------- positions


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """The rotary frequencies theta^(-2i / head_dim), i = 0 .. head_dim / 2 - 1, in fp32."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)


def llama3_scaled_inv_freq(
    inv_freq: torch.Tensor,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    """Llama 3.1's long-context RoPE: slow frequencies divided by ``factor``, fast ones kept, a blend between.

    Wavelengths longer than ``original / low_freq_factor`` are stretched by ``factor``; shorter than
    ``original / high_freq_factor`` stay; those between interpolate linearly in ``original / wavelength``
    (the same numbers as transformers' ``rope_type: llama3``).
    """
    wavelength = 2 * math.pi / inv_freq
    smooth = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original_max_position_embeddings / low_freq_factor, inv_freq / factor, inv_freq)
    is_medium = (wavelength >= original_max_position_embeddings / high_freq_factor) & (
        wavelength <= original_max_position_embeddings / low_freq_factor
    )
    return torch.where(is_medium, blended, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, in fp32, each (batch or 1, seq, 1, head_dim).

    ``inv_freq`` (head_dim / 2,) carries any scaling (``RopeHFConfig.inv_freq``).
    """
    angles = positions.float()[..., None] * inv_freq  # (batch, seq, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch, seq, heads, head_dim) by position, half-split (GPT-NeoX) layout.

    The layout both of LLM Foundry's rope_impls use (HF ``rotate_half``; DAIL with
    ``interleaved=False``). Computed in fp32, returned in ``x``'s dtype.
    """
    x32 = x.float()
    first, second = x32.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def alibi_slopes(n_heads: int, alibi_bias_max: float = 8.0, device: torch.device | None = None) -> torch.Tensor:
    """Per-head ALiBi slopes (n_heads,), LLM Foundry's ``gen_slopes``.

    For a power-of-two head count the slopes are 2^(-alibi_bias_max * h / n_heads), h = 1..n_heads.
    Otherwise they are computed for the next power of two and every other one is taken (odd
    positions first), as HF and FasterTransformer do.
    """
    padded_heads = 2 ** math.ceil(math.log2(n_heads))
    exponents = torch.arange(1, padded_heads + 1, dtype=torch.float32, device=device) * (alibi_bias_max / padded_heads)
    slopes = 1.0 / torch.pow(2, exponents)
    if padded_heads != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes
