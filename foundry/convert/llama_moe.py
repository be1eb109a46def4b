"""The Llama-shaped mixtures of experts (Mixtral, OLMoE, Qwen3-MoE) <-> ``llama_causal_lm`` with ``moe_num_experts``.

The three classes are a Llama whose SwiGLU is a softmax top-k mixture of SwiGLU experts; they differ
in the names of the router and experts, the q/k norm (none, over all heads, per head) and whether
the top-k weights are renormalised. ``MoEFamily`` declares those differences; ``Adapter`` reads one
declaration both ways (export and import), and the rest of each network maps as a Llama's
(``foundry.convert.llama``). transformers 4 stores each expert's three matrices apart
(``experts.<e>.gate_proj.weight``); transformers 5 stacks them (``experts.gate_up_proj``, gate rows
then up rows, and ``experts.down_proj``), in nn.Linear's (out, in) layout as foundry does.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Collection
from typing import Any

import torch
import transformers

from foundry.convert import llama
from foundry.convert.rope import hf_rope_settings
from foundry.errors import ConfigError
from foundry.models.layers import ffn_hidden_size

STACKED_EXPERTS = int(transformers.__version__.split(".")[0]) >= 5
_BLOCK = re.compile(r"^transformer\.blocks\.(\d+)\.(ffn\..+|attn\.[qk]_ln\.weight)$")
_HF_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_QK_NORM_NAMES = {"attn.q_ln.weight": "self_attn.q_norm.weight", "attn.k_ln.weight": "self_attn.k_norm.weight"}


def rotary_moe_checks(config: Any) -> dict[str, bool]:
    """What every Hugging Face MoE class here needs of an ``MPTConfig``: {setting: True if it is missing}.

    SwiGLU experts without shared experts, bias-free layers, unscaled HF-layout RoPE and nothing MPT-only.
    """
    attn, ffn = config.attn_config, config.ffn_config
    return {
        "ffn_config.ffn_type (must be a mixture of experts)": not ffn.is_moe,
        "ffn_config.mlp_type (must be glu)": ffn.mlp_type != "glu",
        "ffn_config.ffn_act_fn (must be silu)": ffn.ffn_act_fn.name != "silu",
        "ffn_config.shared_expert": ffn.shared_expert,
        "ffn_config.uniform_expert_assignment": ffn.uniform_expert_assignment,
        "attn_config.rope (must be true, rope_impl hf, no scaling)": not attn.rope
        or attn.rope_impl != "hf"
        or attn.rope_hf_config.type != "no_scaling",
        "attn_config.alibi": attn.alibi,
        "attn_config.softmax_scale": attn.softmax_scale is not None,
        "attn_config.sliding_window_size": attn.sliding_window_size != -1,
        "learned_pos_emb": config.learned_pos_emb,
        "no_bias (must be true)": not config.no_bias,
        "logit_scale": config.logit_scale is not None,
    }


def warn_unexported_training_settings(config: Any, architecture: str, exported: Collection[str]) -> None:
    """Warn for each MoE setting that only training reads (router z-loss, router jitter), set but not in ``exported``.

    The weights and logits export exactly without them; a run that trains the export under transformers
    goes without them, so the user is told which ones, rather than an export refused for them.
    """
    ffn = config.ffn_config
    settings = {"moe_zloss_weight": ffn.moe_zloss_weight, "moe_jitter_eps": ffn.moe_jitter_eps}
    lost = {key: value for key, value in settings.items() if value and key not in exported}
    if lost:
        listed = ", ".join(f"ffn_config.{key} ({value})" for key, value in lost.items())
        warnings.warn(
            f"{architecture}'s config has no field for {listed}: the exported weights compute the same logits, but "
            "training the export under transformers goes without it. Nothing to fix unless you continue training "
            "there; to keep it, continue from the foundry checkpoint instead.",
            stacklevel=2,
        )


@dataclasses.dataclass(frozen=True)
class MoEFamily:
    """What one Hugging Face MoE class calls things and computes."""

    architecture: str  # the transformers class, e.g. MixtralForCausalLM
    config_class: str  # its config class in transformers
    moe_prefix: str  # the block's MoE module: 'mlp' (transformers 5 for all), 'block_sparse_moe' (Mixtral 4)
    expert_names: tuple[str, str, str]  # transformers 4's per-expert gate, up and down names
    qk_norm: str  # 'none', 'all_heads' (OLMoE), 'per_head' (Qwen3)
    num_experts_key: str  # the config key of the expert count
    expert_width_key: str  # the config key of each expert's width
    renormalises: bool | None  # True: always (Mixtral); None: as config.norm_topk_prob says
    extra_config: tuple[tuple[str, Any], ...] = ()  # fixed keys the export writes
    jitter_key: str | None = None  # the config key of the router jitter (ffn_config.moe_jitter_eps), if any
    own_head_dim: bool = False  # its attention reads config.head_dim (Mixtral, Qwen3-MoE), not hidden / heads

    @property
    def hf_moe_prefix(self) -> str:
        return "mlp" if STACKED_EXPERTS else self.moe_prefix

    @property
    def hf_moe_prefixes(self) -> tuple[str, ...]:
        """Either layout a folder may hold: transformers 5 writes some classes' files in their original names."""
        return tuple(dict.fromkeys(("mlp", self.moe_prefix)))


class Adapter:
    """The five adapter functions of ``foundry.convert`` for one ``MoEFamily``."""

    def __init__(self, family: MoEFamily) -> None:
        self.family = family

    def unmappable_features(self, config: Any) -> list[str]:
        """The settings of an ``MPTConfig`` that this class cannot compute (empty when it can)."""
        attn, ffn, family = config.attn_config, config.ffn_config, self.family
        qk_norm = "all_heads" if attn.qk_ln else "per_head" if attn.qk_gn else "none"
        normalize = ffn.moe_normalize_expert_weights
        checks = {
            **rotary_moe_checks(config),
            f"ffn_config.moe_normalize_expert_weights (must be {'1' if family.renormalises else 'null or 1'})": (
                normalize != 1 if family.renormalises else normalize not in (None, 1)
            ),
            f"qk norm (must be {family.qk_norm})": qk_norm != family.qk_norm,
            "attn_config.clip_qkv": attn.clip_qkv is not None,
            "norm_type (must be an rmsnorm)": "rmsnorm" not in config.norm_type,
            "attn_config.head_dim (must be d_model / n_heads)": config.head_dim_decoupled and not family.own_head_dim,
        }
        return [feature for feature, unmappable in checks.items() if unmappable]

    def to_hf_config(self, model: Any) -> Any:
        family, config = self.family, model.config
        attn, ffn = config.attn_config, config.ffn_config
        keys: dict[str, Any] = {
            "vocab_size": config.vocab_size,
            "hidden_size": config.d_model,
            "num_hidden_layers": config.n_layers,
            "num_attention_heads": config.n_heads,
            "num_key_value_heads": attn.resolve_kv_n_heads(config.n_heads),
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len,
            "rms_norm_eps": float(config.norm_eps),
            "rope_theta": float(attn.rope_theta),
            "tie_word_embeddings": config.tie_word_embeddings,
            "attention_dropout": float(attn.attn_pdrop),
            "initializer_range": float(config.init_config.init_std or 0.02),
            "num_experts_per_tok": ffn.moe_top_k,
            "router_aux_loss_coef": float(ffn.moe_loss_weight),
            family.num_experts_key: ffn.moe_num_experts,
            family.expert_width_key: ffn_hidden_size(config.d_model, config.expansion_ratio, ffn),
            "architectures": [family.architecture],
            **dict(family.extra_config),
        }
        if family.renormalises is None:
            keys["norm_topk_prob"] = ffn.moe_normalize_expert_weights is not None
        if family.jitter_key is not None:
            keys[family.jitter_key] = float(ffn.moe_jitter_eps or 0.0)
        exported = ("moe_jitter_eps",) if family.jitter_key is not None else ()
        warn_unexported_training_settings(config, family.architecture, exported)
        return getattr(transformers, family.config_class)(**keys)

    def to_hf_state_dict(self, state: dict[str, torch.Tensor], model: Any) -> dict[str, torch.Tensor]:
        dense = {name: tensor for name, tensor in state.items() if not _BLOCK.match(name)}
        hf_state = llama.to_hf_state_dict(dense, model)
        prefix, (gate, up, down) = self.family.hf_moe_prefix, self.family.expert_names
        for name, tensor in state.items():
            if not (match := _BLOCK.match(name)):
                continue
            layer, suffix = match.groups()
            hf_layer = f"model.layers.{layer}."
            if suffix in _QK_NORM_NAMES:
                hf_state[hf_layer + _QK_NORM_NAMES[suffix]] = tensor
            elif suffix == "ffn.router.layer.weight":
                hf_state[f"{hf_layer}{prefix}.gate.weight"] = tensor
            elif suffix == "ffn.experts.down_proj" and STACKED_EXPERTS:
                hf_state[f"{hf_layer}{prefix}.experts.down_proj"] = tensor
            elif suffix in ("ffn.experts.gate_proj", "ffn.experts.up_proj", "ffn.experts.down_proj"):
                if STACKED_EXPERTS:  # gate and up together, once (at the gate)
                    if suffix.endswith("gate_proj"):
                        up_weights = state[name.replace("gate_proj", "up_proj")]
                        hf_state[f"{hf_layer}{prefix}.experts.gate_up_proj"] = torch.cat([tensor, up_weights], dim=1)
                    continue
                hf_name = {"gate_proj": gate, "up_proj": up, "down_proj": down}[suffix.rsplit(".", 1)[1]]
                for expert, weight in enumerate(tensor):
                    hf_state[f"{hf_layer}{prefix}.experts.{expert}.{hf_name}.weight"] = weight.clone()
            else:
                raise ConfigError(f"{self.family.architecture} export does not know the parameter '{name}'.")
        return hf_state

    def from_hf_config(self, hf_config: Any) -> dict[str, Any]:
        """The ``model:`` section of a foundry YAML for this class's config."""
        family = self.family
        problems = {
            "mlp_only_layers": bool(getattr(hf_config, "mlp_only_layers", None)),
            "decoder_sparse_step": getattr(hf_config, "decoder_sparse_step", 1) != 1,
            "use_sliding_window": bool(getattr(hf_config, "use_sliding_window", False)),
            "sliding_window": getattr(hf_config, "sliding_window", None) is not None
            and family.architecture == "MixtralForCausalLM",
            "clip_qkv": getattr(hf_config, "clip_qkv", None) is not None,
            "rope_scaling": hf_rope_settings(hf_config)[1] is not None,
        }
        for key, unsupported in problems.items():
            if unsupported:
                raise ConfigError(
                    f"This {family.architecture} checkpoint sets '{key}' to {getattr(hf_config, key, None)!r}, which "
                    "foundry's MoE does not implement; train it as `model: {name: hf_causal_lm, "
                    "pretrained_model_name_or_path: <dir>}` instead."
                )
        jitter = getattr(hf_config, family.jitter_key, 0.0) if family.jitter_key is not None else 0.0
        if jitter:
            warnings.warn(
                f"This {family.architecture} checkpoint sets '{family.jitter_key}' to {jitter}, a router jitter that "
                "only training applies; llama_causal_lm has no such setting, so the imported model trains without "
                "it (its logits are the same).",
                stacklevel=2,
            )
        section = llama.from_hf_config(hf_config)
        renormalises = family.renormalises or (family.renormalises is None and bool(hf_config.norm_topk_prob))
        section.update(
            ffn_hidden_size=getattr(hf_config, family.expert_width_key),
            qk_norm=family.qk_norm,
            moe_num_experts=getattr(hf_config, family.num_experts_key),
            moe_top_k=hf_config.num_experts_per_tok,
            moe_normalize_expert_weights=1.0 if renormalises else None,
            moe_loss_weight=float(hf_config.router_aux_loss_coef),
        )
        return section

    def from_hf_state_dict(self, hf_state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
        family = self.family
        moe_names, dense = {}, {}
        for name, tensor in hf_state.items():
            match = _HF_BLOCK.match(name)
            is_moe = match and (
                match.group(2).startswith(tuple(f"{prefix}." for prefix in family.hf_moe_prefixes))
                or match.group(2) in _QK_NORM_NAMES.values()
            )
            (moe_names if is_moe else dense)[name] = tensor
        state = llama.from_hf_state_dict(dense, hf_config)
        return state | self._moe_state(moe_names, hf_config)

    def _moe_state(self, hf_state: dict[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
        prefixes, names = self.family.hf_moe_prefixes, self.family.expert_names
        ours = dict(zip(names, ("gate_proj", "up_proj", "down_proj")))
        qk_norms = {hf: foundry for foundry, hf in _QK_NORM_NAMES.items()}
        state: dict[str, torch.Tensor] = {}
        per_expert: dict[str, dict[int, torch.Tensor]] = {}
        width = getattr(hf_config, self.family.expert_width_key)
        num_experts = getattr(hf_config, self.family.num_experts_key)

        def put(target: str, tensor: torch.Tensor, name: str) -> None:
            if target in state:  # e.g. a router under both mlp.gate and block_sparse_moe.gate
                raise self._two_layouts(name, target)
            state[target] = tensor

        for name, tensor in hf_state.items():
            layer, suffix = _HF_BLOCK.match(name).groups()
            block = f"transformer.blocks.{layer}."
            moe_suffix = next(
                (suffix.removeprefix(f"{prefix}.") for prefix in prefixes if suffix.startswith(f"{prefix}.")), suffix
            )
            if moe_suffix in ("experts.gate_up_proj", "experts.down_proj") and tensor.shape[0] != num_experts:
                raise self._incomplete(f"hold {tensor.shape[0]} experts in '{name}'", num_experts)
            if suffix in qk_norms:
                put(block + qk_norms[suffix], tensor, name)
            elif moe_suffix == "gate.weight":
                put(block + "ffn.router.layer.weight", tensor, name)
            elif moe_suffix == "experts.gate_up_proj":
                gate, up = tensor.split(width, 1)
                put(block + "ffn.experts.gate_proj", gate, name)
                put(block + "ffn.experts.up_proj", up, name)
            elif moe_suffix == "experts.down_proj":
                put(block + "ffn.experts.down_proj", tensor, name)
            elif (expert := re.match(r"^experts\.(\d+)\.(\w+)\.weight$", moe_suffix)) and expert.group(2) in ours:
                target = f"{block}ffn.experts.{ours[expert.group(2)]}"
                per_expert.setdefault(target, {})[int(expert.group(1))] = tensor
            else:
                raise ConfigError(f"{self.family.architecture} import does not know the parameter '{name}'.")
        for target, experts in per_expert.items():
            missing = sorted(set(range(num_experts)) - set(experts))
            if missing or len(experts) != num_experts:
                raise self._incomplete(
                    f"lack experts {missing or sorted(experts)[num_experts:]} for '{target}'", num_experts
                )
            put(target, torch.stack([experts[e] for e in range(num_experts)]), f"{target} (per expert)")
        return {name: tensor.contiguous() for name, tensor in state.items()}

    def _two_layouts(self, name: str, target: str) -> ConfigError:
        return ConfigError(
            f"The {self.family.architecture} weights set '{target}' twice (again from '{name}'): the folder holds "
            "both expert layouts (transformers 4's per-expert matrices and transformers 5's stacked ones, or the "
            "router under two names), so which is the model is ambiguous. Keep the files of one save."
        )

    def _incomplete(self, what: str, num_experts: int) -> ConfigError:
        """The import's refusal of weights that do not hold the experts config.json names (``what`` they do)."""
        return ConfigError(
            f"The {self.family.architecture} weights {what} ({self.family.num_experts_key} is {num_experts} in "
            "config.json). The folder is incomplete or its config.json belongs to another model: download or export "
            "it again."
        )
