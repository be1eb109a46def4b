"""foundry's Llama-family MoE <-> ``transformers.OlmoeForCausalLM``: q/k RMSNorm over all heads, raw top-k weights."""

from foundry.convert.llama_moe import Adapter, MoEFamily

FAMILY = "llama_causal_lm"
_ADAPTER = Adapter(
    MoEFamily(
        architecture="OlmoeForCausalLM",
        config_class="OlmoeConfig",
        moe_prefix="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"),
        qk_norm="all_heads",
        num_experts_key="num_experts",
        expert_width_key="intermediate_size",
        renormalises=None,
        extra_config=(("clip_qkv", None), ("attention_bias", False)),
    )
)
unmappable_features = _ADAPTER.unmappable_features
to_hf_config = _ADAPTER.to_hf_config
to_hf_state_dict = _ADAPTER.to_hf_state_dict
from_hf_config = _ADAPTER.from_hf_config
from_hf_state_dict = _ADAPTER.from_hf_state_dict
