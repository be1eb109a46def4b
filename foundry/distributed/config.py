"""``fsdp_config``: LLM Foundry's FSDP keys, validated here and applied by ``foundry.distributed.fsdp``."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Literal

from foundry.schema import doc, field_defaults


@dataclasses.dataclass(kw_only=True)
class FSDPConfig:
    """LLM Foundry's ``fsdp_config`` keys; validated here, applied by ``foundry.distributed``."""

    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"] = (
        field(default="FULL_SHARD", metadata=doc("how parameters, gradients and optimizer state are sharded"))
    )
    mixed_precision: Literal["DEFAULT", "PURE", "FULL"] = field(
        default="DEFAULT", metadata=doc("with amp precisions: PURE/DEFAULT/FULL compute and reduce dtypes")
    )
    activation_checkpointing: bool = field(default=False, metadata=doc("recompute block activations in backward"))
    activation_checkpointing_reentrant: bool = field(
        default=False, metadata=doc("torch's reentrant checkpoint (default: the non-reentrant one torch recommends)")
    )
    activation_cpu_offload: bool = field(
        default=False, metadata=doc("offload saved activations to the CPU (CUDA only)")
    )
    limit_all_gathers: bool = field(
        default=True, metadata=doc("no effect (accepted for LLM Foundry YAMLs): FSDP2 bounds in-flight all-gathers")
    )
    sync_module_states: bool = field(default=False, metadata=doc("broadcast rank 0's weights at wrap time"))
    use_orig_params: bool = field(
        default=True, metadata=doc("no effect (accepted for LLM Foundry YAMLs): FSDP2 always uses the parameters")
    )
    state_dict_type: Literal["full", "sharded", "local"] = field(
        default="full",
        metadata=doc("no effect (accepted for LLM Foundry YAMLs): checkpoints are always sharded DCP folders"),
    )
    forward_prefetch: bool = field(default=False, metadata=doc("prefetch the next all-gather in forward"))
    backward_prefetch: Literal["BACKWARD_PRE", "BACKWARD_POST", "NONE"] = field(
        default="BACKWARD_POST",
        metadata=doc("no effect (accepted for LLM Foundry YAMLs): FSDP2 always prefetches the next block in backward"),
    )
    reduce_every_microbatch: bool | None = field(
        default=None,
        metadata=doc(
            "reduce-scatter gradients after every microbatch (Composer's schedule) rather than once a batch, which "
            "holds unsharded gradient sums; null (auto): once a batch when the model is small for the device"
        ),
    )
    reshard_between_microbatches: bool | None = field(
        default=None,
        metadata=doc(
            "free gathered parameters between a batch's microbatches; false keeps them gathered until the batch's "
            "last backward (one all-gather per block a batch); null (auto): kept when the model is small for the device"
        ),
    )
    expert_parallel_degree: int = field(
        default=1,
        metadata=doc(
            "ranks over which each MoE layer's experts are split, tokens moving between them by all-to-all "
            "(foundry.distributed.expert_parallel); 1: every rank holds all experts (FSDP shards them); else the "
            "number of ranks"
        ),
    )
    verbose: bool = field(default=False, metadata=doc("log how modules are wrapped"))
    cpu_offload: bool = field(default=False, metadata=doc("keep shards and the optimizer step on the CPU (CUDA only)"))


FSDP_DEFAULTS = field_defaults(FSDPConfig)
