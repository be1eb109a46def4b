"""MPT's (and so Llama's) tensor-parallel plan: which linears of each block split by column, which by row.

Attention's fused Wqkv splits by column with its query, key and value parts each split by heads, so every rank
holds whole heads; ``out_proj`` splits by row. The FFN's up (and gate) projection splits by column, its down
projection by row. Embeddings, norms and the output head stay whole on every rank. ``check_tensor_parallel``
refuses, naming the key, a shape or feature the plan cannot split; the config checks and the plan share it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from foundry.distributed.tensor_parallel import FusedColwiseParallel
from foundry.errors import ConfigError
from foundry.models.layers import ffn_hidden_size

_KEY = "parallelism.tensor_parallel_degree"


def check_tensor_parallel(config: Any, degree: int) -> None:
    """Whether ``degree`` ranks can split a model of ``config`` (an ``MPTConfig``, which imports this module):
    heads and FFN width divide, and no feature the plan does not split is on."""
    if degree == 1:
        return
    attn = config.attn_config
    unsupported = {
        "model.peft_config (LoRA)": config.peft_config is not None,
        "model.ffn_config.ffn_type (a mixture of experts)": config.ffn_config.is_moe,
        "model.attn_config.alibi": attn.alibi,
        "model.attn_config.qk_ln": attn.qk_ln,
        "model.attn_config.qk_gn": attn.qk_gn,
    }
    for key, used in unsupported.items():
        if used:
            raise ConfigError(
                f"'{_KEY}' is {degree} but {key} is set; tensor parallelism does not split that yet. Turn it off, "
                "or set the degree to 1 (FSDP alone)."
            )
    kv_n_heads = attn.resolve_kv_n_heads(config.n_heads)
    if kv_n_heads != config.n_heads:
        raise ConfigError(
            f"'{_KEY}' is {degree} but the model's attention has {kv_n_heads} key/value heads for {config.n_heads} "
            "query heads (model.kv_n_heads / attn_config.kv_n_heads, attn_type); tensor parallelism splits only "
            "multi-head attention yet, whose fused Wqkv splits into equal query, key and value parts. Set kv_n_heads "
            "to n_heads (multi_head_attention), or the degree to 1."
        )
    hidden = ffn_hidden_size(config.d_model, config.expansion_ratio, config.ffn_config)
    for key, count in (
        ("model.n_heads", config.n_heads),
        ("the FFN width (d_model x expansion_ratio, or ffn_hidden_size)", hidden),
    ):
        if count % degree:
            raise ConfigError(
                f"'{_KEY}' is {degree}, which does not divide {key} ({count}): each rank holds an equal share. "
                f"Choose a degree that divides it, or set it to 1."
            )


def mpt_tensor_parallel_plan(blocks: list[nn.Module]) -> dict[str, ParallelStyle]:
    """The plan over ``blocks`` (``transformer.blocks``), named from the model's root."""
    plan: dict[str, ParallelStyle] = {}
    for index, block in enumerate(blocks):
        prefix = f"transformer.blocks.{index}"
        plan[f"{prefix}.attn.Wqkv"] = FusedColwiseParallel(parts=3)  # (q, k, v), each split by heads
        plan[f"{prefix}.attn.out_proj"] = RowwiseParallel()
        for name in ("up_proj", "gate_proj"):
            if hasattr(block.ffn, name):
                plan[f"{prefix}.ffn.{name}"] = ColwiseParallel()
        plan[f"{prefix}.ffn.down_proj"] = RowwiseParallel()
    return plan
