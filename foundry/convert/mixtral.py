"""foundry's Llama-family MoE <-> ``transformers.MixtralForCausalLM``: no q/k norm, top-k weights renormalised."""

from foundry.convert.llama_moe import Adapter, MoEFamily

FAMILY = "llama_causal_lm"
_ADAPTER = Adapter(
    MoEFamily(
        architecture="MixtralForCausalLM",
        config_class="MixtralConfig",
        moe_prefix="block_sparse_moe",
        expert_names=("w1", "w3", "w2"),
        qk_norm="none",
        num_experts_key="num_local_experts",
        expert_width_key="intermediate_size",
        renormalises=True,
        own_head_dim=True,
        extra_config=(("sliding_window", None),),
        jitter_key="router_jitter_noise",
    )
)
unmappable_features = _ADAPTER.unmappable_features
to_hf_config = _ADAPTER.to_hf_config
to_hf_state_dict = _ADAPTER.to_hf_state_dict
from_hf_config = _ADAPTER.from_hf_config
from_hf_state_dict = _ADAPTER.from_hf_state_dict
