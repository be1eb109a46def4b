"""A dropless mixture-of-experts feed-forward: token-choice top-k routing over grouped experts.

For each token the router's softmax picks ``top_k`` experts; the token's output is the sum of those
experts' outputs weighted by their router probabilities (renormalised to unit p-norm when
``normalize_expert_weights`` is set), plus an optional shared expert every token goes through, plus
an optional output bias (MegaBlocks'). Every assignment is computed (``foundry.models.experts``).

Each forward records its routing (``MoE.routing``), from which the model adds two loss terms:

- load balancing (Switch / GShard, MegaBlocks' ``batched_load_balancing_loss``, which LLM Foundry's
  ``moe_loss_weight`` scales)::

      load_balancing = moe_loss_weight * mean over layers of
                       num_experts / (tokens * top_k) * sum_e tokens_per_expert[e] * mean_t probs[t, e]

  where ``tokens_per_expert`` counts top-k assignments (they sum to tokens * top_k) and ``probs`` is
  the router's softmax before the top-k; a perfectly even router gives ``moe_loss_weight``.
- router z-loss (ST-MoE): ``moe_zloss_weight * mean over layers of mean_t logsumexp(logits[t])^2``.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch
from torch import nn

from foundry.models.experts import GroupedExperts
from foundry.models.init import InitFn
from foundry.models.layers import GLU, MLP, ActFnConfig, FFNConfig, check_moe_keys

_KEY = "model.ffn_config"


@dataclasses.dataclass
class MoEConfig:
    """One MoE feed-forward's shape and routing; built from a family's own keys (MPT's ffn_config, Llama's)."""

    num_experts: int
    top_k: int
    hidden_size: int  # each expert's FFN width
    act: ActFnConfig = dataclasses.field(default_factory=ActFnConfig)
    glu: bool = False
    normalize_expert_weights: float | None = None  # p of the norm the top-k weights are divided by; None: kept
    shared_expert_hidden_size: int | None = None  # a dense expert every token uses, of this width; None: none
    bias: bool = False  # a d_model output bias (MegaBlocks')
    load_balancing_weight: float = 0.0
    z_loss_weight: float = 0.0
    jitter_eps: float | None = None  # training multiplies router inputs by U(1 - eps, 1 + eps)
    uniform_expert_assignment: bool = False  # benchmarking: token i goes to experts i*k .. i*k+k-1 mod E
    key: str = _KEY  # where these keys live in the YAML, for error messages

    def __post_init__(self) -> None:
        check_moe_keys(self.num_experts, self.top_k, self.normalize_expert_weights, f"{self.key}.")


def moe_config_from_ffn(ffn_config: FFNConfig, hidden_size: int, bias: bool) -> MoEConfig:
    """LLM Foundry's ``mb_moe`` / ``mb_dmoe`` ffn_config keys (MegaBlocks' ``Arguments``) as an ``MoEConfig``."""
    if ffn_config.ffn_type == "mb_moe" and ffn_config.moe_capacity_factor > 0:
        warnings.warn(
            f"'{_KEY}.ffn_type' is mb_moe, whose MegaBlocks layer drops tokens past "
            f"moe_capacity_factor={ffn_config.moe_capacity_factor}; foundry's MoE computes every token (as mb_dmoe).",
            stacklevel=4,
        )
    shared_hidden = ffn_config.shared_expert_hidden_size or hidden_size
    return MoEConfig(
        num_experts=ffn_config.moe_num_experts,
        top_k=ffn_config.moe_top_k,
        hidden_size=hidden_size,
        act=ffn_config.ffn_act_fn or ActFnConfig(),
        glu=ffn_config.mlp_type == "glu",
        normalize_expert_weights=ffn_config.moe_normalize_expert_weights,
        shared_expert_hidden_size=shared_hidden if ffn_config.shared_expert else None,
        bias=bias,
        load_balancing_weight=ffn_config.moe_loss_weight,
        z_loss_weight=ffn_config.moe_zloss_weight,
        jitter_eps=ffn_config.moe_jitter_eps,
        uniform_expert_assignment=ffn_config.uniform_expert_assignment,
    )


@dataclasses.dataclass
class Routing:
    """One forward's routing, kept for the loss terms and the load metrics.

    ``tokens_per_expert`` (experts,): top-k assignments per expert; ``mean_probs`` (experts,): the
    router softmax averaged over tokens; ``z`` (): mean over tokens of logsumexp(logits)^2.
    """

    tokens_per_expert: torch.Tensor
    mean_probs: torch.Tensor
    z: torch.Tensor

    @property
    def load_balancing(self) -> torch.Tensor:
        """This layer's unweighted Switch/GShard loss: 1 for a perfectly even router."""
        counts = self.tokens_per_expert.to(self.mean_probs)  # they sum to tokens * top_k
        return self.mean_probs.numel() / counts.sum() * torch.dot(counts, self.mean_probs)


class Router(nn.Module):
    """Token-choice top-k: softmax over ``num_experts`` logits, the k largest with their probabilities."""

    def __init__(self, d_model: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.layer = nn.Linear(d_model, config.num_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, d_model) -> logits and fp32 probs (tokens, experts), fp32 weights and expert ids (tokens, k)."""
        config = self.config
        if self.training and config.jitter_eps is not None:
            x = x * torch.empty_like(x).uniform_(1 - config.jitter_eps, 1 + config.jitter_eps)
        logits = self.layer(x)
        probs = logits.float().softmax(dim=-1)
        weights, expert_ids = probs.topk(config.top_k, dim=-1)
        if config.normalize_expert_weights is not None:
            weights = weights / weights.norm(p=config.normalize_expert_weights, dim=-1, keepdim=True)
        if config.uniform_expert_assignment:
            assigned = torch.arange(expert_ids.numel(), device=x.device).view_as(expert_ids)
            expert_ids = assigned % config.num_experts
        return logits, probs, weights, expert_ids


class MoE(nn.Module):
    """The MoE feed-forward: (batch, seq, d_model) -> (batch, seq, d_model); ``routing`` holds the last forward's."""

    def __init__(self, d_model: int, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.router = Router(d_model, config)
        self.experts = GroupedExperts(config.num_experts, d_model, config.hidden_size, config.act, config.glu)
        self.shared_expert: MLP | None = None
        if config.shared_expert_hidden_size:
            shared_class = GLU if config.glu else MLP
            self.shared_expert = shared_class(d_model, config.shared_expert_hidden_size, config.act, bias=False)
        self.bias = nn.Parameter(torch.empty(d_model)) if config.bias else None
        self.routing: Routing | None = None
        # Training assignments per expert since the moe_monitor callback last read them (None: none since).
        self.assignments_since_read: torch.Tensor | None = None
        self._warned_no_grad = False

    def init_weights_with(self, weight_init: InitFn, residual_divisor: float | None) -> None:
        """The output bias starts at zero (the router, experts and shared expert are initialised as submodules)."""
        del weight_init, residual_divisor
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @property
    def inactive_params(self) -> int:
        """Expert parameters a token does not use: all experts' but its top_k (MFU counts active parameters)."""
        expert_params = sum(p.numel() for p in self.experts.parameters())
        return expert_params * (self.config.num_experts - self.config.top_k) // self.config.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (tokens, d_model)
        logits, probs, weights, expert_ids = self.router(x)
        out, tokens_per_expert = self.experts.route(x, expert_ids, weights)
        if self.training and not torch.is_grad_enabled() and not self._warned_no_grad:
            self._warned_no_grad = True
            warnings.warn(
                "An MoE layer ran a training forward without gradients (reentrant activation checkpointing does), so "
                "its load-balancing and z-loss terms cannot train the router. Use non-reentrant checkpointing "
                "(fsdp_config.activation_checkpointing_reentrant: false, the default).",
                stacklevel=2,
            )
        if self.training:
            counts, so_far = tokens_per_expert.detach(), self.assignments_since_read
            self.assignments_since_read = counts if so_far is None else so_far + counts
        self.routing = Routing(
            tokens_per_expert=tokens_per_expert,
            mean_probs=probs.mean(dim=0),
            z=torch.logsumexp(logits.float(), dim=-1).square().mean(),
        )
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        if self.bias is not None:
            out = out + self.bias
        return out.view(shape)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE feed-forwards of ``model``, in order."""
    return [module for module in model.modules() if isinstance(module, MoE)]


def moe_loss_terms(layers: list[MoE]) -> dict[str, torch.Tensor]:
    """The weighted load-balancing and z-loss terms of the layers' last forwards (those with a weight)."""
    routings = [layer.routing for layer in layers if layer.routing is not None]
    if not routings:
        return {}
    config = layers[0].config
    terms = {}
    if config.load_balancing_weight:
        per_layer = torch.stack([routing.load_balancing for routing in routings])
        terms["load_balancing"] = config.load_balancing_weight * per_layer.mean()
    if config.z_loss_weight:
        terms["router_z"] = config.z_loss_weight * torch.stack([routing.z for routing in routings]).mean()
    return terms


def expert_load(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """max / mean tokens per expert: 1 is a perfect balance, num_experts all tokens on one expert."""
    counts = tokens_per_expert.float()
    return counts.max() / counts.mean().clamp(min=1e-9)


__all__ = ["MoE", "MoEConfig", "Router", "Routing", "expert_load", "moe_layers", "moe_loss_terms"]
