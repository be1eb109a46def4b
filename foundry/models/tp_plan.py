"""MPT's (and so Llama's) tensor-parallel plan: which linears of each block split by column, which by row.

Attention's fused Wqkv splits by column with its query, key and value parts each split by heads, so every rank
holds whole heads, and with grouped-query attention the query heads of its own key/value heads; ``out_proj``
splits by row. The FFN's up (and gate) projection splits by column, its down projection by row. A LoRA layer
splits with its base: ``lora_B`` as a column-split weight (``lora_A`` whole), ``lora_A`` as a row-split one
(``lora_B`` whole). Embeddings, norms and the output head stay whole on every rank. ``check_tensor_parallel``
refuses, naming the key, a shape or feature the plan cannot split; the config checks and the plan share it.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from foundry.distributed.tensor_parallel import (
    AdaptedColwiseParallel,
    AdaptedRowwiseParallel,
    FusedColwiseParallel,
    SequenceLayout,
)
from foundry.errors import ConfigError
from foundry.models.layers import ffn_hidden_size
from foundry.models.lora import LoRALinear

_KEY = "parallelism.tensor_parallel_degree"


def check_tensor_parallel(config: Any, degree: int) -> None:
    """Whether ``degree`` ranks can split a model of ``config`` (an ``MPTConfig``, which imports this module):
    heads and FFN width divide, and no feature the plan does not split is on."""
    if degree == 1:
        return
    attn = config.attn_config
    kv_n_heads = attn.resolve_kv_n_heads(config.n_heads)
    unsupported = {
        "model.peft_config.quantize_base (QLoRA)": config.peft_config is not None and config.peft_config.quantize_base,
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
    hidden = ffn_hidden_size(config.d_model, config.expansion_ratio, config.ffn_config)
    for key, count in (
        ("model.n_heads", config.n_heads),
        ("model.kv_n_heads (attn_config.kv_n_heads; 1 for multiquery_attention)", kv_n_heads),
        ("the FFN width (d_model x expansion_ratio, or ffn_hidden_size)", hidden),
    ):
        if count % degree:
            raise ConfigError(
                f"'{_KEY}' is {degree}, which does not divide {key} ({count}): each rank holds an equal share. "
                f"Choose a degree that divides it, or set it to 1."
            )


def mpt_tensor_parallel_plan(blocks: list[nn.Module], sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The plan over ``blocks`` (``transformer.blocks``), named from the model's root. With ``sequence_parallel``
    the residual stream runs through the blocks split over the sequence: each rank normalises its share of the
    tokens, gathers the whole sequence before attention and the FFN, and its row-split projections reduce-scatter
    (instead of all-reduce) back to its share; the sequence is split where it enters the first block and gathered
    before the final norm."""

    def rowwise(linear: nn.Module) -> ParallelStyle:
        if isinstance(linear, LoRALinear):
            return AdaptedRowwiseParallel(sequence_parallel)
        return RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()

    plan: dict[str, ParallelStyle] = {}
    for index, block in enumerate(blocks):
        prefix = f"transformer.blocks.{index}"
        queries_per_kv = block.attn.n_heads // block.attn.kv_n_heads
        plan[f"{prefix}.attn.Wqkv"] = FusedColwiseParallel(queries_per_kv)  # (q, k, v), each split by heads
        plan[f"{prefix}.attn.out_proj"] = rowwise(block.attn.out_proj)
        for name in ("up_proj", "gate_proj"):
            if hasattr(block.ffn, name):
                linear = getattr(block.ffn, name)
                plan[f"{prefix}.ffn.{name}"] = (
                    AdaptedColwiseParallel() if isinstance(linear, LoRALinear) else ColwiseParallel()
                )
        plan[f"{prefix}.ffn.down_proj"] = rowwise(block.ffn.down_proj)
        if sequence_parallel:  # each norm on its share of the tokens; attention and the FFN on all of them
            plan.update({f"{prefix}.{norm}": SequenceParallel() for norm in ("norm_1", "norm_2")})
            gather = SequenceLayout("gather", local_output=False)
            plan.update({f"{prefix}.{layer}": gather for layer in ("attn", "ffn")})
    if sequence_parallel:
        plan["transformer.blocks.0"] = SequenceLayout("split", local_output=True)
        plan["transformer.norm_f"] = SequenceLayout("gather", local_output=True)
    return plan
