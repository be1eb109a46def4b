"""foundry's Llama-family MoE <-> ``transformers.Qwen3MoeForCausalLM``: q/k RMSNorm per head, every layer sparse."""

from foundry.convert.llama_moe import Adapter, MoEFamily

FAMILY = "llama_causal_lm"
_ADAPTER = Adapter(
    MoEFamily(
        architecture="Qwen3MoeForCausalLM",
        config_class="Qwen3MoeConfig",
        moe_prefix="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"),
        qk_norm="per_head",
        num_experts_key="num_experts",
        expert_width_key="moe_intermediate_size",
        renormalises=None,
        own_head_dim=True,
        extra_config=(
            ("decoder_sparse_step", 1),
            ("mlp_only_layers", []),
            ("use_sliding_window", False),
            ("attention_bias", False),
        ),
    )
)
unmappable_features = _ADAPTER.unmappable_features
to_hf_config = _ADAPTER.to_hf_config
to_hf_state_dict = _ADAPTER.to_hf_state_dict
from_hf_config = _ADAPTER.from_hf_config
from_hf_state_dict = _ADAPTER.from_hf_state_dict
