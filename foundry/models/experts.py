"""Dropless expert computation: tokens sorted by expert, then one grouped GEMM per projection.

Every (token, expert) assignment of a top-k router is computed: nothing is dropped for capacity.
``sort_by_expert`` lays the assignments out expert by expert without a Python loop over tokens (an
argsort and a few gathers, all of fixed size: no host sync, and ``torch.compile`` traces it as one graph
with static shapes); ``GroupedExperts`` runs each projection of every expert in
one ``grouped_mm`` on a Hopper-class GPU in bf16, and as a loop over each expert's contiguous slice
elsewhere (CPU, fp32, older GPUs), which gives the same numbers as a per-token loop. Each row's router
weight multiplies its hidden activation before the down projection, so ``combine`` only sums each token's
rows: one gather-and-sum, with no per-assignment copy of the outputs made or kept for backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from foundry.core.precision import autocast_dtype
from foundry.distributed.protocol import ExpertExchange
from foundry.models.init import InitFn
from foundry.models.layers import ActFnConfig, activation

# grouped_mm reads each expert's rows in 16-byte-aligned groups: bf16 rows come in multiples of 8.
GROUPED_MM_ROW_ALIGNMENT = 8
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@dataclasses.dataclass
class ExpertLayout:
    """Where each (token, expert) assignment sits in the expert-sorted buffer.

    ``slot_of_assignment`` (tokens * top_k,): the buffer row of assignment ``t * top_k + j``;
    ``assignment_of_slot`` (rows,): its inverse, ``tokens * top_k`` for padding; ``source_of_slot``
    (rows,): the token each buffer row copies, ``tokens`` (a zero row) for padding;
    ``tokens_per_expert`` (experts,): assignments per expert; ``group_ends`` (experts,) int32: where
    each expert's rows end in the buffer, padding included; ``top_k``: assignments per token.
    """

    slot_of_assignment: torch.Tensor
    assignment_of_slot: torch.Tensor
    source_of_slot: torch.Tensor
    tokens_per_expert: torch.Tensor
    group_ends: torch.Tensor
    top_k: int


def sort_by_expert(expert_ids: torch.Tensor, num_experts: int, row_alignment: int = 1) -> ExpertLayout:
    """The expert-sorted layout of ``expert_ids`` (tokens, top_k); each expert's rows padded to ``row_alignment``.

    The buffer has a fixed size, ``tokens * top_k + num_experts * (row_alignment - 1)``, so nothing
    waits for the counts on the host; rows past the last group are never read.
    """
    top_k = expert_ids.shape[1]
    flat = expert_ids.flatten()
    order = flat.argsort(stable=True)  # assignments grouped by expert, token order kept within a group
    tokens_per_expert = count_per_expert(flat, num_experts)
    padded = (tokens_per_expert + row_alignment - 1) // row_alignment * row_alignment
    group_ends = padded.cumsum(0)
    sorted_experts = flat[order]
    rank_in_group = (
        torch.arange(flat.numel(), device=flat.device)
        - (tokens_per_expert.cumsum(0) - tokens_per_expert)[sorted_experts]
    )
    slots = (group_ends - padded)[sorted_experts] + rank_in_group
    rows = flat.numel() + num_experts * (row_alignment - 1)
    slot_of_assignment = torch.empty_like(slots).scatter_(0, order, slots)
    assignment_of_slot = torch.full((rows,), flat.numel(), dtype=torch.long, device=flat.device)
    assignment_of_slot = assignment_of_slot.scatter(0, slots, order)
    source_of_slot = assignment_of_slot // top_k  # padding: tokens * top_k // top_k, the zero row
    return ExpertLayout(
        slot_of_assignment, assignment_of_slot, source_of_slot, tokens_per_expert, group_ends.int(), top_k
    )


def count_per_expert(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert (experts,) int64 of the flat ``expert_ids``: ``bincount``'s counts without its costs.

    On CUDA ``torch.bincount`` reads the ids' min and max on the host (two device syncs per call), and
    its output's size depends on the data, which breaks ``torch.compile``'s graph; a scatter-add into
    ``num_experts`` zeros has neither.
    """
    counts = expert_ids.new_zeros(num_experts, dtype=torch.long)
    return counts.scatter_add_(0, expert_ids.long(), torch.ones_like(expert_ids, dtype=torch.long))


def dispatch(x: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """(tokens, d_model) -> (rows, d_model): each assignment's token at its slot, zeros in padding."""
    return _Dispatch.apply(x, layout.source_of_slot, layout.slot_of_assignment, layout.top_k)


def combine(expert_out: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """(rows, d_model) -> (tokens, d_model): the sum of each token's ``top_k`` rows (already router-weighted)."""
    return _Combine.apply(expert_out, layout.slot_of_assignment, layout.source_of_slot, layout.top_k)


def undo_sort(expert_out: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """(rows, d_model) -> (tokens * top_k, d_model): each assignment's output, in assignment order, padding dropped."""
    return _Combine.apply(expert_out, layout.slot_of_assignment, layout.assignment_of_slot, 1)


def slot_weights(weights: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """(tokens, top_k) router weights -> (rows,): each buffer row's weight, 0 in padding (undo_sort's transpose)."""
    per_assignment = weights.reshape(-1, 1)
    return _Dispatch.apply(per_assignment, layout.assignment_of_slot, layout.slot_of_assignment, 1).squeeze(1)


def _gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Row ``index[i]`` of ``x`` for each i; index ``len(x)`` reads a zero row (padding)."""
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, index)


def _sum_groups(rows: torch.Tensor, index: torch.Tensor, group: int) -> torch.Tensor:
    """Rows ``index`` of ``rows``, each consecutive ``group`` of them summed: (len(index) / group, d).

    Compiled, the sum is written as ``group`` gathers added in fp32, which the compiler fuses into one
    elementwise kernel whose threads read along d_model; its kernel for gather-then-``sum(1)`` spreads the
    group across threads and reads at about a third of the bandwidth (a 2 GB combine at 0.85 TB/s on an H100).
    Eager keeps the one gather and sum: the unrolled form would write each gather out. fp32 rows are summed
    without casts: torch 2.11's dynamo returned wrong gradients through a custom autograd Function whose
    forward held a no-op ``.float()`` (fp32 MoE training, compiled, was off by 0.05 in loss after one step).
    """
    if group == 1:
        return rows.index_select(0, index)
    if torch.compiler.is_compiling():
        columns = index.view(-1, group)
        upcast = rows.dtype != torch.float32
        total = rows.index_select(0, columns[:, 0])
        total = total.float() if upcast else total
        for j in range(1, group):
            gathered = rows.index_select(0, columns[:, j])
            total = total + (gathered.float() if upcast else gathered)
        return total.to(rows.dtype) if upcast else total
    return rows.index_select(0, index).view(-1, group, rows.shape[1]).sum(1)


# Dispatch (tokens to buffer rows) and combine (rows to tokens, each token's top_k rows summed) are each
# other's transpose, and undo_sort is combine with one row per output. Each backward is the other forward,
# a gather: index_select's own backward would be a scatter-add into a zeroed buffer, with atomics (run-to-run
# differences in bf16); these sum in a fixed order and zero nothing first.
class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(x: torch.Tensor, source_of_row: torch.Tensor, row_of_output: torch.Tensor, group: int) -> torch.Tensor:
        return _gather_rows(x, source_of_row)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        _, _, row_of_output, ctx.group = inputs
        ctx.save_for_backward(row_of_output)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_rows: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (row_of_output,) = ctx.saved_tensors
        return _sum_groups(grad_rows, row_of_output, ctx.group), None, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(
        rows: torch.Tensor, row_of_output: torch.Tensor, source_of_row: torch.Tensor, group: int
    ) -> torch.Tensor:
        return _sum_groups(rows, row_of_output, group)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        ctx.save_for_backward(inputs[2])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (source_of_row,) = ctx.saved_tensors
        return _gather_rows(grad_out, source_of_row), None, None, None  # padding rows: zeros


@torch.compiler.assume_constant_result  # a property of the device: compiled code need not re-check it
def grouped_mm_runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM serves ``dtype`` on ``device``: bf16 on a CUDA GPU of compute capability 9.0+."""
    return (
        _grouped_mm is not None
        and device.type == "cuda"
        and dtype == torch.bfloat16
        and torch.cuda.get_device_capability(device) >= (9, 0)
    )


class GroupedExperts(nn.Module):
    """``num_experts`` feed-forward networks whose weights are stacked: (experts, out, in), nn.Linear's layout.

    ``glu``: ``down(act(gate(x)) * up(x))`` (Mixtral, OLMoE, Qwen3-MoE, DBRX); else ``down(act(up(x)))``.
    ``use_grouped_mm`` None picks the grouped GEMM wherever it runs (``grouped_mm_runs_on``); False
    forces the per-expert loop (the benchmark's baseline).
    """

    def __init__(self, num_experts: int, d_model: int, hidden: int, act: ActFnConfig, glu: bool) -> None:
        super().__init__()
        self.num_experts, self.glu = num_experts, glu
        self.act = activation(act)
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, d_model))
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden, d_model)) if glu else None
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.use_grouped_mm: bool | None = None
        # How rows reach experts on other ranks: None runs them all here; expert parallelism sets an exchange.
        self.exchange: ExpertExchange | None = None

    # The row layout, as methods: expert parallelism (foundry.distributed) routes with them.
    sort_by_expert = staticmethod(sort_by_expert)
    dispatch = staticmethod(dispatch)
    undo_sort = staticmethod(undo_sort)
    combine = staticmethod(combine)
    slot_weights = staticmethod(slot_weights)

    def init_weights_with(self, weight_init: InitFn, residual_divisor: float | None) -> None:
        """Each expert's matrix initialised as its own nn.Linear weight would be (foundry/models/init.py)."""
        for name in ("up_proj", "gate_proj", "down_proj"):
            weight = getattr(self, name)
            if weight is None:
                continue
            local = self.local(weight)  # an FSDP2 or expert-parallel shard: this rank's experts
            for expert_weight in local:
                weight_init(expert_weight)
            if name == "down_proj" and residual_divisor is not None:
                local.div_(residual_divisor)

    @staticmethod
    def local(weight: torch.Tensor) -> torch.Tensor:
        """This rank's experts of ``weight``: all of them, or its shard under expert parallelism (a DTensor)."""
        # isinstance, not hasattr: torch.compile resolves hasattr on a DTensor parameter to False
        return weight.to_local() if isinstance(weight, DTensor) else weight

    def row_alignment(self, x: torch.Tensor) -> int:
        """How ``sort_by_expert`` must pad each expert's rows for this input."""
        return GROUPED_MM_ROW_ALIGNMENT if self._uses_grouped_mm(x) else 1

    def _uses_grouped_mm(self, x: torch.Tensor) -> bool:
        dtype = autocast_dtype(x.device.type) or x.dtype
        runs = grouped_mm_runs_on(x.device, dtype)
        return runs if self.use_grouped_mm is None else self.use_grouped_mm and runs

    def route(
        self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token (tokens, d_model) through its experts (tokens, top_k), outputs summed with ``weights``.

        Returns the (tokens, d_model) outputs and the assignments per expert (experts,). Under expert
        parallelism (``foundry.distributed.expert_parallel``) the rows travel through ``exchange``.
        """
        if self.exchange is not None:
            return self.exchange.route(self, x, expert_ids, weights)
        layout = sort_by_expert(expert_ids, self.num_experts, self.row_alignment(x))
        rows = self(dispatch(x, layout), layout, slot_weights(weights, layout))
        return combine(rows, layout), layout.tokens_per_expert

    def forward(self, x: torch.Tensor, layout: ExpertLayout, row_weights: torch.Tensor | None = None) -> torch.Tensor:
        """(rows, d_model) expert-sorted tokens -> (rows, d_model); padding rows give zeros.

        ``row_weights`` (rows,): each row's router weight, by which its output is multiplied. The down
        projection is linear, so the weight scales its input: fused by the compiler into the activation's
        elementwise kernel, where scaling the output would be a pass of its own over (rows, d_model).
        """
        weights = [self.local(w) for w in (self.up_proj, self.gate_proj, self.down_proj) if w is not None]
        dtype = autocast_dtype(x.device.type) or x.dtype  # autocast does not cover grouped_mm: cast here
        x, weights = x.to(dtype), [w.to(dtype) for w in weights]
        if self._uses_grouped_mm(x):
            project = lambda inputs, weight: _grouped_mm(inputs, weight.transpose(-2, -1), offs=layout.group_ends)  # noqa: E731
        else:
            project = self._project_per_expert(layout)
        up = project(x, weights[0])
        hidden = self.act(project(x, weights[1])) * up if self.glu else self.act(up)
        if row_weights is not None:
            hidden = hidden * row_weights.to(hidden.dtype).unsqueeze(1)
        return project(hidden, weights[-1])

    def _project_per_expert(self, layout: ExpertLayout) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """A projection that multiplies each expert's contiguous rows by its own matrix (reads the counts once)."""
        ends = layout.group_ends.tolist()
        starts = [0, *ends[:-1]]

        def project(inputs: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            outputs = [F.linear(inputs[start:end], weight[e]) for e, (start, end) in enumerate(zip(starts, ends))]
            tail = inputs.new_zeros(inputs.shape[0] - ends[-1], weight.shape[1])  # unused rows past the groups
            return torch.cat([*outputs, tail])

        return project
