"""The distributed sections: ``fsdp_config`` (LLM Foundry's FSDP keys) and ``parallelism`` (the mesh's degrees).

Validated here; ``foundry.distributed.mesh`` lays the ranks out and ``foundry.distributed.fsdp`` applies them.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import field
from typing import Literal

from foundry.deprecation import FoundryDeprecationWarning
from foundry.errors import ConfigError
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
    activation_checkpointing: bool | Literal["auto"] = field(
        default=False,
        metadata=doc(
            "recompute block activations in backward; auto (foundry train): the fewest whole blocks that let the "
            "step fit the GPU, by the dry run's plan"
        ),
    )
    activation_checkpointing_reentrant: bool = field(
        default=False, metadata=doc("torch's reentrant checkpoint (default: the non-reentrant one torch recommends)")
    )
    activation_checkpointing_keep_attention: bool = field(
        default=False,
        metadata=doc(
            "with activation_checkpointing: keep each attention kernel's output (and log-sum-exp) from the forward, "
            "so backward recomputes everything but attention (long context; costs tokens x heads x head_dim x 2 "
            "bytes a layer)"
        ),
    )
    activation_cpu_offload: bool = field(
        default=False, metadata=doc("offload saved activations to the CPU (CUDA only)")
    )
    limit_all_gathers: bool = field(
        default=True, metadata=doc("no effect (accepted for LLM Foundry YAMLs): FSDP2 bounds in-flight all-gathers")
    )
    sync_module_states: bool = field(default=False, metadata=doc("broadcast rank 0's weights at wrap time"))
    init_on_device: bool = field(
        default=False,
        metadata=doc(
            "draw a meta-device model's random initial weights on the GPUs (rank 0, a module at a time) rather than "
            "the host's CPU generator (minutes at 70B, half an hour at 405B), but other values than a CPU draw"
        ),
    )
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
    expert_parallel_degree: int | None = field(
        default=None, metadata=doc("deprecated spelling of parallelism.expert_parallel_degree (warns; same meaning)")
    )
    verbose: bool = field(default=False, metadata=doc("log how modules are wrapped"))
    cpu_offload: bool = field(default=False, metadata=doc("keep shards and the optimizer step on the CPU (CUDA only)"))

    def __post_init__(self) -> None:
        if not self.activation_checkpointing_keep_attention:
            return
        if not self.activation_checkpointing:
            raise ConfigError(
                "fsdp_config.activation_checkpointing_keep_attention is true but fsdp_config.activation_checkpointing "
                "is false: keeping the attention outputs is a choice within checkpointing (without checkpointing every "
                "activation is kept anyway). Set activation_checkpointing: true, or drop the keep_attention key."
            )
        if self.activation_checkpointing_reentrant:
            raise ConfigError(
                "fsdp_config.activation_checkpointing_keep_attention needs torch's non-reentrant checkpoint (selective "
                "checkpointing runs through it), but fsdp_config.activation_checkpointing_reentrant is true. Set "
                "activation_checkpointing_reentrant: false (the default), or keep_attention: false."
            )


FSDP_DEFAULTS = field_defaults(FSDPConfig)


CONTEXT_PARALLEL_ATTENTION = ("auto", "end_aligned", "split")


@dataclasses.dataclass(kw_only=True)
class ParallelismConfig:
    """``parallelism``: how many ranks share each dimension of the work beyond data parallelism (torchtitan's keys).

    The ranks left over after every degree here are the data-parallel ones; FSDP2 shards parameters over
    data × context ranks (torchtitan's ``dp_shard_cp``), so context parallelism costs no extra weight memory.
    """

    context_parallel_degree: int = field(
        default=1,
        metadata=doc(
            "ranks that split each sequence along its length, causally load-balanced (long context; "
            "docs/DISTRIBUTED.md); must divide the number of ranks. 1: every rank holds whole sequences"
        ),
    )
    context_parallel_attention: str = field(
        default="auto",
        metadata=doc(
            "how a rank's later chunk attends to the keys before it under context parallelism: 'split', a full "
            "block plus a causal square on cuDNN's kernel merged by their log-sum-exps (an 8B model at 64k trains "
            "1.35-1.39x faster on two H100s; warns where it cannot run); 'end_aligned', one kernel call whose causal "
            "mask aligns to the last key (FlashAttention-2 through SDPA); 'auto': split where it runs (no "
            "dropout; cuDNN on a GPU, the CPU's kernel), else end_aligned. FlashAttention-4 runs where the "
            "layer's kernel picks it, whatever this says (docs/DISTRIBUTED.md)"
        ),
    )
    expert_parallel_degree: int = field(
        default=1,
        metadata=doc(
            "ranks over which each MoE layer's experts are split, tokens moving between them by all-to-all "
            "(foundry.distributed.expert_parallel, the mesh's 'ep' axis); 1: every rank holds all experts (FSDP "
            "shards them); else the number of ranks, with context_parallel_degree 1"
        ),
    )

    tensor_parallel_degree: int = field(
        default=1,
        metadata=doc(
            "ranks that split each linear layer of a block by column or row as the model's plan says, seeing the "
            "same samples (Megatron-style tensor parallelism, the mesh's innermost 'tp' axis, 2-D with FSDP2); "
            "must divide the number of ranks and the model's heads and FFN width. 1: every rank holds whole layers"
        ),
    )
    sequence_parallel: bool = field(
        default=True,
        metadata=doc(
            "with tensor_parallel_degree > 1: the residual stream between the split linears is split over the "
            "sequence too (Megatron's sequence parallelism): norms run on each rank's share of the tokens, and "
            "the all-reduces become an all-gather and a reduce-scatter, moving the same bytes while each rank "
            "keeps 1/degree of the blocks' inputs; sequences must hold a multiple of the degree of tokens"
        ),
    )

    def __post_init__(self) -> None:
        if self.tensor_parallel_degree < 1:
            raise ConfigError(
                f"'parallelism.tensor_parallel_degree' is {self.tensor_parallel_degree}; it must be 1 (off) or a "
                "number of ranks that divides the world size, e.g. 2."
            )
        if self.context_parallel_degree < 1:
            raise ConfigError(
                f"'parallelism.context_parallel_degree' is {self.context_parallel_degree}; it must be 1 (off) or a "
                "number of ranks that divides the world size, e.g. 2."
            )
        if self.context_parallel_attention not in CONTEXT_PARALLEL_ATTENTION:
            raise ConfigError(
                f"'parallelism.context_parallel_attention' is {self.context_parallel_attention!r}; it must be one of "
                f"{', '.join(map(repr, CONTEXT_PARALLEL_ATTENTION))}."
            )
        if self.expert_parallel_degree < 1:
            raise ConfigError(
                f"'parallelism.expert_parallel_degree' is {self.expert_parallel_degree}; it must be 1 (off) or the "
                "number of ranks, e.g. 2."
            )


def with_fsdp_aliases(parallelism: ParallelismConfig, fsdp_config: FSDPConfig) -> ParallelismConfig:
    """``parallelism`` with the degree ``fsdp_config.expert_parallel_degree`` (its deprecated spelling) sets.

    Called once per model placement, so a run warns once.
    """
    alias = fsdp_config.expert_parallel_degree
    if alias is None:
        return parallelism
    warnings.warn(
        f"fsdp_config.expert_parallel_degree is deprecated: write 'parallelism: {{expert_parallel_degree: {alias}}}' "
        "instead (same meaning; one mesh holds every parallel degree).",
        FoundryDeprecationWarning,
        stacklevel=3,
    )
    if parallelism.expert_parallel_degree not in (1, alias):
        raise ConfigError(
            f"fsdp_config.expert_parallel_degree is {alias} but parallelism.expert_parallel_degree is "
            f"{parallelism.expert_parallel_degree}; they name the same degree. Keep only "
            "parallelism.expert_parallel_degree."
        )
    return dataclasses.replace(parallelism, expert_parallel_degree=alias)


def check_parallelism(parallelism: ParallelismConfig, world_size: int | None, num_experts: int | None = None) -> None:
    """The degrees against the job's ranks and the model's experts per MoE layer, read from the config alone, so
    that ``foundry train`` refuses them before any rank starts.

    ``world_size``: the job's ranks (None: not known yet, as for ``--print-config`` without ``--nproc``);
    ``num_experts``: None for a dense model, or one whose section foundry cannot read without building it.
    """
    ep, cp, tp = (
        parallelism.expert_parallel_degree,
        parallelism.context_parallel_degree,
        parallelism.tensor_parallel_degree,
    )
    if ep > 1 and cp > 1:
        raise ConfigError(
            f"'parallelism.expert_parallel_degree' is {ep} and 'parallelism.context_parallel_degree' is {cp}; foundry "
            "does not combine expert and context parallelism. Set one of the two keys to 1."
        )
    if tp > 1 and ep > 1:
        raise ConfigError(
            f"'parallelism.tensor_parallel_degree' is {tp} and 'parallelism.expert_parallel_degree' is {ep}; foundry "
            "does not combine tensor and expert parallelism yet. Set one of the two keys to 1."
        )
    if world_size is not None and world_size % cp:
        raise ConfigError(
            f"'parallelism.context_parallel_degree' is {cp}, which does not divide the {_ranks(world_size)} of this "
            f"job. Launch a multiple of {cp} ranks (`foundry train --nproc {cp}`) or lower the degree."
        )
    if world_size is not None and world_size % tp:
        raise ConfigError(
            f"'parallelism.tensor_parallel_degree' is {tp}, which does not divide the {_ranks(world_size)} of this "
            f"job. Launch a multiple of {tp} ranks (`foundry train --nproc {tp}`) or lower the degree."
        )
    if ep > 1 and world_size is not None and ep != world_size:
        fix = (
            f"launch {ep} ranks (`foundry train --nproc {ep}`), or set it to 1"
            if world_size == 1
            else f"set it to {world_size}, or to 1"
        )
        raise ConfigError(
            f"'parallelism.expert_parallel_degree' is {ep} but the run has {_ranks(world_size)}; expert parallelism "
            f"splits the experts over every rank: {fix} (FSDP shards the experts)."
        )
    if num_experts is not None:
        check_experts_divide(ep, num_experts)


def check_experts_divide(expert_parallel_degree: int, num_experts: int) -> None:
    """Each of the ranks holds the same number of each MoE layer's experts."""
    if num_experts % expert_parallel_degree == 0:
        return
    divisors = [str(d) for d in range(2, num_experts + 1) if num_experts % d == 0][:4]
    fix = "Set"
    if divisors:
        fix = f"Choose a degree that divides {num_experts} ({', '.join(divisors)}), with as many ranks, or set"
    raise ConfigError(
        f"'parallelism.expert_parallel_degree' is {expert_parallel_degree}, which does not divide the model's "
        f"{num_experts} experts per MoE layer (its moe_num_experts): each rank holds an equal share of them. {fix} it "
        "to 1 (FSDP shards the experts)."
    )


def _ranks(count: int) -> str:
    return f"{count} rank{'' if count == 1 else 's'}"
