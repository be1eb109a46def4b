"""Context parallelism: each sequence split along its length over the ``cp`` ranks, causally load-balanced.

A sequence of S tokens is cut into 2·cp chunks of S / (2·cp); cp rank r holds chunks r and 2·cp-1-r
(head and tail). Under a causal mask chunk c attends to c + 1 chunks of keys, so every rank does the
same attention work: (r + 1) + (2·cp - r) = 2·cp + 1 chunk pairs. Without the pairing the rank holding
the last chunk would do 2·cp - 1 times the work of the first.

``ContextParallel.shard`` turns a loader's batch into this rank's pieces. The cp ranks of one group
first exchange their samples (each loads its own share, as without context parallelism, so loaders,
batch sizes and the global batch stay as they are), then each keeps its two chunks of every sample.
Targets are shifted before the split (a chunk's last target is the next chunk's first token) and
position ids are the tokens' positions in the whole sequence, so RoPE and learned position
embeddings see what they would see unsplit. The loss over a rank's tokens, weighted by its token
count as the Trainer weighs every microbatch, sums to the global batch's mean: the same gradient at
any cp degree.

Attention gathers keys and values from the cp group (autograd-aware: the backward reduce-scatters
their gradients) and runs each local chunk against the prefix of the sequence it may see, with a
causal mask aligned to the chunk's end. Where the layer's kernel runs FlashAttention-4 (``flash`` on a
Hopper or Blackwell GPU with the package, ``fa4``), the chunks run on its custom op, whose causal mask
aligns to the last key when keys outnumber queries and which takes grouped-query heads as they are;
elsewhere, by ``parallelism.context_parallel_attention``, as a full block plus a causal square on cuDNN's
kernel (the CPU's on a CPU) merged by their log-sum-exps (``split``, ``foundry.distributed.split_attention``;
``auto`` where it runs) or on SDPA's end-aligned kernel (``end_aligned``: FlashAttention-2 on a GPU, a masked
kernel on a CPU). Keys and values travel in
the layout the model makes them, (batch, seq, kv_heads, head_dim), and the output is returned as a
transposed view of (batch, seq, heads, head_dim): neither side copies to change layout. This is the
all-gather form of context parallelism that Llama 3 was trained with; with grouped-query attention the
gathered keys and values are a fraction of the queries' size. Document masks (``attn_uses_sequence_id``),
ALiBi, sliding windows and padding are refused, never applied wrongly.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from foundry.distributed.protocol import attention_layers_of
from foundry.distributed.split_attention import end_aligned_attention, in_layout, split_kernel
from foundry.errors import ConfigError
from foundry.targets import SHIFTED_LABELS_KEY, shifted_targets

_KEY = "parallelism.context_parallel_degree"
# ALiBi is an MPT's position signal (unless learned_pos_emb): turned off alone, it would leave the model none.
_ALIBI_FIX = (
    "Give the model rotary positions instead, which context parallelism splits with the tokens: "
    "model.attn_config: {alibi: false, rope: true}, or a Llama-family model (model.name: llama_causal_lm, as "
    f"yamls/quickstart-llama.yaml); or set {_KEY}: 1."
)
# torch 2.14 renamed the autograd-aware all-gather (its backward reduce-scatters the gradient)
_all_gather_autograd = getattr(functional, "all_gather_single_autograd", None) or functional.all_gather_tensor_autograd
# Per-token tensors a split batch carries: each is split along the sequence like input_ids.
SEQUENCE_KEYS = ("input_ids", SHIFTED_LABELS_KEY, "position_ids", "attention_mask", "sequence_id")


def chunks_of_rank(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two of the 2·cp_size sequence chunks that ``cp_rank`` holds: the head and the mirrored tail."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def shard_sequence(tensor: torch.Tensor, cp_rank: int, cp_size: int, dim: int = 1) -> torch.Tensor:
    """``cp_rank``'s head and tail chunks of ``tensor`` along ``dim``, concatenated."""
    length = tensor.shape[dim]
    if length % (2 * cp_size):
        raise ConfigError(
            f"A batch has sequences of {length} tokens, which {_KEY}={cp_size} cannot split into {2 * cp_size} equal "
            f"chunks. Use a max_seq_len that is a multiple of {2 * cp_size}."
        )
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    head, tail = chunks_of_rank(cp_rank, cp_size)
    return torch.cat([chunks[head], chunks[tail]], dim=dim)


def unshard_sequence(pieces: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's pieces (``pieces[r]``: rank r's head and tail along ``dim``)."""
    holder = {}
    for rank, piece in enumerate(pieces):
        head, tail = chunks_of_rank(rank, len(pieces))
        holder[head], holder[tail] = piece.chunk(2, dim=dim)
    return torch.cat([holder[chunk] for chunk in range(2 * len(pieces))], dim=dim)


def _describe(layout: torch.Tensor) -> str:
    """A batch layout of ``ContextParallel._check_same_layout`` in words: its shape and per-token keys."""
    batch, seq, keys = layout.tolist()
    return f"{batch} x {seq} tokens, " + ", ".join(key for index, key in enumerate(SEQUENCE_KEYS) if keys >> index & 1)


class ContextParallel:
    """Splits batches over a cp mesh and, while ``active``, makes the wrapped attention gather keys and values."""

    def __init__(self, cp_mesh: DeviceMesh, attention: str = "auto") -> None:
        self.mesh = cp_mesh
        self.attention_route = attention  # parallelism.context_parallel_attention
        self.rank, self.size = cp_mesh.get_local_rank(), cp_mesh.size()
        self.group = cp_mesh.get_group()
        self.active = False

    @property
    def summary(self) -> str:
        """One line for the run's start: how each sequence is split."""
        return f"context parallelism on: each sequence split over {self.size} ranks ({_KEY}: {self.size})"

    def shard(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """This rank's pieces of every sample the cp group loaded (see the module docstring)."""
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ConfigError(f"{_KEY} splits batches of input_ids (a language model's); this batch has none.")
        input_ids = batch["input_ids"]  # (batch, seq)
        whole = {
            "input_ids": input_ids,
            SHIFTED_LABELS_KEY: shifted_targets(batch),
            "position_ids": batch.get("position_ids", torch.arange(input_ids.shape[1], device=input_ids.device)),
        }
        whole["position_ids"] = whole["position_ids"].expand_as(input_ids)
        for key in ("attention_mask", "sequence_id"):
            if batch.get(key) is not None:
                whole[key] = batch[key]
        self._check_same_layout(whole)
        gathered = self._gather_samples(whole)
        return {key: shard_sequence(value, self.rank, self.size) for key, value in gathered.items()}

    def _check_same_layout(self, whole: Mapping[str, torch.Tensor]) -> None:
        """Every cp rank loaded a batch of one shape with the same keys: otherwise the sample gather would
        hang or mix tokens.

        The layouts travel as a CPU tensor (over the group's gloo backend on a GPU job, whose process group is
        ``cpu:gloo,cuda:nccl``): a few bytes between the hosts a batch, and the host never waits for the
        device's queued work.
        """
        keys = sum(1 << index for index, key in enumerate(SEQUENCE_KEYS) if key in whole)
        layout = torch.tensor([*whole["input_ids"].shape, keys])  # (batch, seq, which keys)
        layouts = [torch.empty_like(layout) for _ in range(self.size)]
        dist.all_gather(layouts, layout, group=self.group)
        if any(not torch.equal(other, layout) for other in layouts):
            described = "; ".join(f"rank {rank}: {_describe(other)}" for rank, other in enumerate(layouts))
            raise ConfigError(
                f"The ranks of a context-parallel group loaded batches of different shapes or keys ({described}); "
                f"{_KEY} needs equal ones. Pad every batch to max_seq_len and drop a last, partial batch "
                "(drop_last: true)."
            )

    def _gather_samples(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every cp rank's samples of each per-token tensor, in rank order along the batch dimension.

        One collective for all of them: the (batch, seq) tensors are stacked as int64 (token ids, positions,
        0/1 masks: exact) and each gets its dtype back. No gradient flows here.
        """
        names = list(tensors)
        stacked = torch.stack([tensors[name].to(torch.long) for name in names])  # (keys, batch, seq)
        gathered = stacked.new_empty((self.size * len(names), *stacked.shape[1:]))  # (cp·keys, batch, seq)
        # torch 2.14 renamed all_gather_into_tensor (deprecated there) to all_gather_single
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(gathered, stacked, group=self.group)
        by_rank = gathered.view(self.size, *stacked.shape)  # (cp, keys, batch, seq)
        return {name: by_rank[:, index].flatten(0, 1).to(tensors[name].dtype) for index, name in enumerate(names)}

    @contextlib.contextmanager
    def activated(self) -> Iterator[None]:
        """Forwards and backwards inside run attention over the split sequence (recomputation included)."""
        previous, self.active = self.active, True
        try:
            yield
        finally:
            self.active = previous

    def attention(
        self,
        attn_fn: Callable[..., torch.Tensor],
        runs_flash_attention4: Callable[[torch.Tensor, torch.Tensor, float], bool],
    ) -> Callable[..., torch.Tensor]:
        """``attn_fn`` (a kernel of ``foundry.models.attention``) that gathers keys and values while active.

        ``runs_flash_attention4(q, k, dropout_p)``: whether the layer's kernel would run FlashAttention-4 on
        these inputs (the layer's method of that name); the split sequence then runs on it too.
        """

        def attention(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: Any, scale: float, dropout_p: float
        ) -> torch.Tensor:
            if not self.active:  # a forward over whole sequences: ICL evaluation, generation
                return attn_fn(q, k, v, inputs, scale, dropout_p)
            _refuse_masks(inputs)
            flash_attention4 = runs_flash_attention4(q, k, dropout_p)
            return self.split_sequence_attention(q, k, v, scale, dropout_p, flash_attention4)

        return attention

    def split_sequence_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        dropout_p: float,
        flash_attention4: bool = False,
    ) -> torch.Tensor:
        """Causal attention of this rank's (head, tail) queries over the whole sequence's keys and values.

        q (batch, heads, 2·chunk, head_dim); k and v (batch, kv_heads, 2·chunk, head_dim), this rank's pieces,
        as the models make them: transposed views of (batch, 2·chunk, heads, head_dim). ``flash_attention4``:
        run the chunks on foundry's FlashAttention-4 op (the caller checked it can), else on SDPA. Returns
        q's shape, a transposed view of (batch, 2·chunk, heads, head_dim).
        """
        whole_k, whole_v = (self._gather_sequence(x.transpose(1, 2)) for x in (k, v))  # (batch, seq, kv_heads, dim)
        q = q.transpose(1, 2)  # (batch, 2·chunk, heads, head_dim)
        chunk = q.shape[1] // 2
        if flash_attention4:
            attend = _flash_attention4_prefix
        else:
            attend = functools.partial(_sdpa_prefix_attention, attention=self.attention_route)
        head, tail = chunks_of_rank(self.rank, self.size)
        outputs = [
            attend(queries, whole_k[:, :key_len], whole_v[:, :key_len], scale, dropout_p)
            for queries, key_len in ((q[:, :chunk], (head + 1) * chunk), (q[:, chunk:], (tail + 1) * chunk))
        ]
        return torch.cat(outputs, dim=1).transpose(1, 2)

    def _gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, 2·chunk, kv_heads, head_dim) pieces -> the whole (batch, seq, kv_heads, head_dim), one copy
        after the collective: gathered along the batch dimension, the chunks are put in order by one cat."""
        gathered = _all_gather_autograd(x.contiguous(), gather_dim=0, group=self.group)  # (cp·batch, 2·chunk, ...)
        by_rank = functional.wait_tensor(gathered).unflatten(0, (self.size, -1)).unbind(0)
        return unshard_sequence(by_rank, dim=1)


def _flash_attention4_prefix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float
) -> torch.Tensor:
    """q (batch, chunk, heads, head_dim) ending k and v (batch, keys, kv_heads, head_dim) -> q's shape.

    FlashAttention aligns its causal mask to the last key when keys outnumber queries (query i sees keys up
    to keys - chunk + i: the tail chunk's mask); with as many keys it is plain causal (rank 0's head). Its
    kernels take any strides with a contiguous last dimension, and grouped-query heads as they are. The op
    is foundry's (foundry/models/flash_attention4.py), called by name so that this module stays apart from
    the models package; the layer's ``runs_flash_attention4`` said that it runs (so dropout_p is 0).
    """
    return torch.ops.foundry.flash_attention4_forward(q, k, v, scale)[0]


def _sdpa_prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float, attention: str = "auto"
) -> torch.Tensor:
    """``_flash_attention4_prefix`` on SDPA, through transposed views: SDPA takes (batch, heads, seq, head_dim).

    ``attention`` (``parallelism.context_parallel_attention``): with ``split`` or ``auto``, a chunk with more
    keys than queries runs as a full block and a causal square merged by their log-sum-exps
    (``foundry.distributed.split_attention``) where that has a kernel and there is no dropout; ``split`` warns
    where it cannot."""
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    key_len = k.shape[2]
    grouped = k.shape[1] != q.shape[1]
    if q.shape[2] == key_len:  # the first chunk: plain causal
        return _causal_chunk_attention(q, k, v, scale, dropout_p).transpose(1, 2)
    if grouped:  # the end-aligned causal kernels take equal head counts
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    kernel = split_kernel(q) if attention != "end_aligned" and dropout_p == 0.0 else None
    if kernel is not None:
        return end_aligned_attention(q, k, v, scale, kernel).transpose(1, 2)
    if attention == "split":
        why = "attention dropout is on" if dropout_p else f"no kernel runs it here ({q.device.type}, {q.dtype})"
        warnings.warn(
            f"parallelism.context_parallel_attention is 'split', but {why}: the chunks run 'end_aligned' "
            "(split needs cuDNN's attention: an NVIDIA GPU from Ampere on, fp16/bf16, head_dim <= 128, no dropout; "
            "or a CPU).",
            stacklevel=2,
        )
    if _flash_runs(q):
        # FlashAttention aligns its causal mask to the last key when keys outnumber queries. Called as the
        # op (as torch's CausalBias does) so that torch.compile traces it: CausalBias breaks the graph.
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True, scale=scale)[0]
        return out.transpose(1, 2)
    # A plain bool mask, not torch's CausalBias: a tensor subclass cannot be made under selective checkpointing.
    mask = torch.ones(q.shape[2], key_len, dtype=torch.bool, device=q.device).tril(key_len - q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale).transpose(1, 2)


def _causal_chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, dropout_p: float
) -> torch.Tensor:
    """The first chunk's plain causal attention, (batch, heads, chunk, head_dim) in and out.

    The chunk's output gradient arrives as a slice of the whole sequence's (``torch.cat``'s backward), laid out
    unlike the output; cuDNN's backward misreads it (wrong gradients: tests/distributed/test_context_parallel_gpu.py).
    An identity that copies it into the output's layout holds in eager mode, but under torch.compile inductor lays
    the gradient out itself. So where cuDNN runs, the chunk runs as ``end_aligned_attention``'s one causal piece,
    whose backward (an opaque op) lays the gradient out at run time; with dropout, FlashAttention-2's op, which
    reads any layout; elsewhere SDPA, behind that identity.
    """
    repeats = q.shape[1] // k.shape[1]
    kernel = split_kernel(q) if dropout_p == 0.0 else None
    if kernel == "cudnn" or (dropout_p and _flash_runs(q)):
        if repeats > 1:  # these kernels take equal head counts
            k, v = (x.repeat_interleave(repeats, dim=1) for x in (k, v))
        if kernel == "cudnn":
            return end_aligned_attention(q, k, v, scale, kernel)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, True, scale=scale)[0]
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=repeats > 1
    )
    return _GradientInOutputLayout.apply(out)


class _GradientInOutputLayout(torch.autograd.Function):
    """Identity whose backward hands the gradient on in the output's own strides.

    A chunk's output gradient arrives as a slice of the whole sequence's (``torch.cat``'s backward), which is
    not dense where a microbatch holds several sequences. cuDNN's backward misreads such a gradient; it no
    longer runs behind this (``_causal_chunk_attention``), but the SDPA kernels that do (efficient, math, the
    CPU's, ROCm's) are verified on GPUs only with the gradient in the output's layout, so the chunk keeps
    handing it over that way: one copy of a chunk's gradient, in eager mode.
    """

    @staticmethod
    def forward(ctx, out):  # type: ignore[no-untyped-def, override]
        ctx.layout = out.stride()
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return in_layout(grad, ctx.layout)


def _flash_runs(q: torch.Tensor) -> bool:
    """Whether SDPA's FlashAttention kernel takes ``q`` (CUDA, half precision, head_dim a multiple of 8 up to 256)."""
    head_dim = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256


def _refuse_masks(inputs: Any) -> None:
    """Context parallelism runs plain causal attention only; any other mask would be applied to the wrong keys."""
    if getattr(inputs, "bias", None) is not None or getattr(inputs, "score_mod", None) is not None:
        raise ConfigError(
            f"{_KEY} runs plain causal attention, but this model adds ALiBi (model.attn_config.alibi). {_ALIBI_FIX}"
        )
    if getattr(inputs, "allowed", None) is not None or getattr(inputs, "block_mask", None) is not None:
        raise ConfigError(
            f"{_KEY} runs plain causal attention, but this batch needs a mask: padding, a sliding window "
            "(model.attn_config.sliding_window_size) or document masking (model.attn_config.attn_uses_sequence_id). "
            "Train on unpadded, concatenated sequences (the text loader's concat_tokens) with those keys off, or "
            "without context parallelism."
        )


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, attention: str = "auto") -> ContextParallel:
    """Wrap the attention kernel of every attention layer of ``model``; returns what splits its batches.

    ``attention``: ``parallelism.context_parallel_attention`` (``auto``, ``end_aligned`` or ``split``)."""
    context_parallel = ContextParallel(cp_mesh, attention)
    layers = attention_layers_of(model)
    if not layers:
        raise ConfigError(
            f"{_KEY} is {cp_mesh.size()}, but {type(model).__name__} declares no attention layers to split "
            "sequences over (attention_layers() of foundry.distributed.protocol.ParallelModel). Use model.name: "
            "mpt_causal_lm or llama_causal_lm, or set the degree to 1."
        )
    for layer in layers:
        if (key := layer.mask_beyond_causal()) is not None:
            refuse_mask_key(key)
        layer.attn_fn = context_parallel.attention(layer.attn_fn, layer.runs_flash_attention4)
    return context_parallel


def refuse_mask_key(key: str) -> None:
    """Refuse the ``attn_config`` key that needs a mask beyond causal (when the config is read, and again per layer)."""
    fix = _ALIBI_FIX if key == "alibi" else f"Turn model.attn_config.{key} off, or set {_KEY}: 1."
    raise ConfigError(
        f"model.attn_config.{key} is set, but {_KEY} > 1 runs plain causal attention only (each rank's "
        f"queries against the gathered keys), so that mask would be wrong. {fix}"
    )


class WholeSequences:
    """Batches as loaded: every rank holds whole sequences (no context parallelism)."""

    summary: str | None = None  # nothing to say at the run's start

    def shard(self, batch: Any) -> Any:
        return batch

    def activated(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()
