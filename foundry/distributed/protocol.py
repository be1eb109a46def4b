"""What ``foundry.distributed`` asks of a model: its blocks, its attention layers, its expert layers, and (for
tensor parallelism) which linears split by column and which by row.

A model family declares these three lists (torchtitan's families declare their parallelize plan the same
way); sharding, activation checkpointing, compiling per block, context parallelism and expert parallelism plan
from them and never look inside a model for attribute names. ``foundry.models.FoundryModel`` implements
``ParallelModel`` (MPT, Llama and their MoE variants fill all three lists, ``hf_causal_lm`` its blocks), and MPT
and Llama ``ModuleByModuleInit`` (their weights, LoRA's too, are initialised a module at a time when sharded),
``hf_causal_lm`` ``StreamedWeights`` (its pretrained weights are read a layer at a time when sharded). A model
foundry does not own (a plain ``nn.Module`` handed to the Trainer, a bare Hugging Face model) gets its blocks
from ``_no_split_modules``, transformers' own declaration of the same thing, and no attention or expert layers.

distributed/ imports nothing from ``foundry.models``: the models implement these protocols, not the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

# (q, k, v, inputs, scale, dropout_p) -> attention output; ``inputs`` carries the layer's masks and positions
AttentionKernel = Callable[..., torch.Tensor]


@runtime_checkable
class AttentionLayer(Protocol):
    """An attention layer whose kernel context parallelism may wrap (keys and values gathered over ranks)."""

    attn_fn: AttentionKernel

    def runs_flash_attention4(self, q: torch.Tensor, k: torch.Tensor, dropout_p: float) -> bool:
        """Whether ``attn_fn`` takes these inputs through FlashAttention-4 (its own causal alignment)."""
        ...

    def mask_beyond_causal(self) -> str | None:
        """The config key (e.g. ``alibi``) that gives this layer a mask beyond causal, or None for plain causal."""
        ...


@runtime_checkable
class ShardedLayer(Protocol):
    """A layer whose parameters need adjusting once ``fully_shard`` has replaced them by shards (QLoRA's NF4)."""

    def after_sharding(self) -> None:
        """Make this layer's sharded parameters ready to be filled and gathered."""
        ...


def finish_sharding(model: nn.Module) -> None:
    """Call ``after_sharding`` on each layer of ``model`` that declares it."""
    for module in model.modules():
        if isinstance(module, ShardedLayer):
            module.after_sharding()


class ExpertExchange(Protocol):
    """How an expert layer's tokens reach experts held on other ranks (set by expert parallelism)."""

    def route(
        self, experts: ExpertLayer, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``experts.route``'s result, its rows exchanged with the ranks holding their experts."""
        ...


@runtime_checkable
class ExpertLayer(Protocol):
    """An ``nn.Module`` of stacked experts (dimension 0 of each direct parameter is the expert) and its row layout.

    ``exchange`` None runs every expert locally; expert parallelism shards the stacked weights and sets it.
    The layout methods are those of ``foundry.models.experts``: distributed code routes rows with them.
    """

    num_experts: int
    exchange: ExpertExchange | None

    def sort_by_expert(self, expert_ids: torch.Tensor, num_experts: int, alignment: int = 1) -> Any: ...
    def dispatch(self, x: torch.Tensor, layout: Any) -> torch.Tensor: ...
    def undo_sort(self, rows: torch.Tensor, layout: Any) -> torch.Tensor: ...
    def combine(self, rows: torch.Tensor, layout: Any) -> torch.Tensor: ...
    def slot_weights(self, weights: torch.Tensor, layout: Any) -> torch.Tensor: ...
    def row_alignment(self, x: torch.Tensor) -> int: ...
    def __call__(self, rows: torch.Tensor, layout: Any, row_weights: torch.Tensor | None = None) -> torch.Tensor: ...


@runtime_checkable
class ParallelModel(Protocol):
    """A model that names what each parallelism acts on."""

    def parallel_blocks(self) -> Sequence[nn.Module]:
        """The repeated blocks, in order: each is sharded, checkpointed and compiled as one unit."""
        ...

    def attention_layers(self) -> Sequence[AttentionLayer]:
        """Every attention layer whose kernel context parallelism may split; empty: none can be split."""
        ...

    def expert_layers(self) -> Sequence[ExpertLayer]:
        """Every mixture-of-experts layer's experts; empty for a dense model."""
        ...


InitStep = tuple[nn.Module, Callable[[nn.Module], None]]  # a module, and what initialises its own parameters


@runtime_checkable
class ModuleByModuleInit(Protocol):
    """A model whose ``init_weights()`` is a sequence of steps, each touching one module's own parameters: a sharded
    placement then initialises one module at a time, never the whole model on one host."""

    def init_steps(self) -> list[InitStep] | None:
        """The steps of ``init_weights()`` in its order (the seed's draws follow it), or None when it does more."""
        ...


def init_steps_of(model: nn.Module) -> list[InitStep] | None:
    return model.init_steps() if isinstance(model, ModuleByModuleInit) else None


@runtime_checkable
class StreamedWeights(Protocol):
    """A model whose initial weights are read from files (a pretrained checkpoint), not drawn: a sharded placement
    reads them a layer at a time on every rank, each rank keeping its slices."""

    def weight_layers(self) -> Iterator[dict[str, torch.Tensor]] | None:
        """The whole initial weights by parameter name, a layer at a time; None when they cannot be streamed."""
        ...


def weight_layers_of(model: nn.Module) -> Iterator[dict[str, torch.Tensor]] | None:
    return model.weight_layers() if isinstance(model, StreamedWeights) else None


@runtime_checkable
class TensorParallelModel(Protocol):
    """A model that declares how tensor parallelism splits it (torchtitan's per-family parallelize plan)."""

    def tensor_parallel_plan(self, degree: int, sequence_parallel: bool) -> Mapping[str, ParallelStyle]:
        """torch's ``parallelize_module`` plan for ``degree`` ranks: {module name: ColwiseParallel(), ...}; with
        ``sequence_parallel``, the residual stream between the split linears sharded over the sequence.

        Raises ``ConfigError`` naming the config key when the model's shape or a feature it uses cannot be split
        over ``degree`` ranks; the model then also uses each rank's share of its heads and widths.
        """
        ...


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The blocks ``model`` declares, or, for a model foundry does not own, those its ``_no_split_modules`` name."""
    if isinstance(model, ParallelModel):
        return list(model.parallel_blocks())
    return no_split_blocks(model)


def no_split_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules whose class a Hugging Face model lists in ``_no_split_modules`` (its decoder layers)."""
    no_split = {name for module in model.modules() for name in getattr(module, "_no_split_modules", None) or ()}
    return [module for module in model.modules() if type(module).__name__ in no_split]


def attention_layers_of(model: nn.Module) -> list[AttentionLayer]:
    return list(model.attention_layers()) if isinstance(model, ParallelModel) else []


def expert_layers_of(model: nn.Module) -> list[ExpertLayer]:
    return list(model.expert_layers()) if isinstance(model, ParallelModel) else []
