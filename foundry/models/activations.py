"""What a block's forward keeps for its backward, per token, from the model's shape alone (no tensor is built).

The count is the eager one: the tensors autograd saves in one MPT or Llama block, in the compute dtype,
measured with ``torch.autograd.graph.saved_tensors_hooks`` on blocks of the same proportions
(docs/DISTRIBUTED.md). Per token, in elements of the compute dtype:

- each norm: its input upcast to fp32 (two elements) and its output (one): ``3 · d_model``;
- attention: q, k and v (``q_dim + 2 · kv_dim``, ``q_dim`` = heads × head_dim, d_model unless ``head_dim`` is
  set) and the attention output (``q_dim``);
- a plain MLP: the first linear's output and the activation's (``2 · ffn``); a GLU: gate, up, the
  activation of the gate and the product (``4 · ffn``);
- an MoE layer: each of ``top_k`` routed rows (``d_model``), its expert's GLU or MLP (as above, ``ffn`` the
  expert's width), and its output before the weighted sum (``d_model``).

A compiled block fuses the norms' intermediates and keeps less, so for ``compile_config: auto`` the eager count
is an upper bound (docs/DISTRIBUTED.md "Dry run" compares it with measured peaks).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from foundry.kernels.linear_cross_entropy import chunk_tokens_for
from foundry.models.layers import ffn_hidden_size

FP32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class BlockShape:
    """The widths that set a block's activations and what its parallel layouts send."""

    d_model: int
    n_heads: int
    q_dim: int  # the width of q and of the attention output: heads × head_dim
    kv_dim: int  # the width of k (and of v): kv heads × head_dim
    ffn_hidden: int  # the MLP's width, or each expert's
    glu: bool
    top_k: int  # routed experts per token; 0: a dense MLP
    n_layers: int
    vocab_size: int

    @classmethod
    def of(cls, config: Any) -> BlockShape:
        """The shape of an ``MPTConfig`` (Llama models carry one as ``model.config``)."""
        attn, ffn = config.attn_config, config.ffn_config
        moe = ffn.ffn_type in ("mb_moe", "mb_dmoe")
        return cls(
            d_model=config.d_model,
            n_heads=config.n_heads,
            q_dim=config.q_dim,
            kv_dim=attn.resolve_kv_n_heads(config.n_heads) * config.head_dim,
            ffn_hidden=ffn_hidden_size(config.d_model, config.expansion_ratio, ffn),
            glu=ffn.ffn_type == "mptglu" or (moe and ffn.mlp_type == "glu"),
            top_k=ffn.moe_top_k if moe else 0,
            n_layers=config.n_layers,
            vocab_size=config.vocab_size,
        )

    def saved_elements_per_token(self) -> int:
        """Elements (of the compute dtype) one block without checkpointing keeps for its backward, per token."""
        norm = 3 * self.d_model
        attention = norm + self.q_dim + 2 * self.kv_dim + self.q_dim
        mlp = (4 if self.glu else 2) * self.ffn_hidden
        if self.top_k:
            mlp = self.top_k * (self.d_model + mlp + self.d_model)
        return attention + norm + mlp

    def kept_attention_bytes_per_token(self, element_bytes: int) -> int:
        """What ``activation_checkpointing_keep_attention`` keeps a block: the output and its log-sum-exp."""
        return self.q_dim * element_bytes + self.n_heads * FP32_BYTES


@dataclasses.dataclass(frozen=True)
class ActivationPlan:
    """How a microbatch's activations are held: which blocks are checkpointed, in what dtypes, which loss."""

    tokens: int  # this rank's tokens in one microbatch (sequence split over context-parallel ranks)
    checkpointed_blocks: int
    keep_attention: bool
    element_bytes: int  # the compute dtype's
    residual_bytes: int  # the residual stream's (a checkpointed block's saved input)
    fused_loss: bool  # the chunked output projection + cross-entropy
    gathered_sequence: int = 1  # context-parallel degree: each attention layer keeps k and v of the whole sequence


def activation_bytes(shape: BlockShape, plan: ActivationPlan) -> int:
    """Peak bytes of activations in one microbatch's forward and backward on one rank.

    Every block left out of the checkpoint keeps its saved tensors; each checkpointed one keeps its input (and,
    with ``keep_attention``, its attention output). Backward adds one block's activations for each
    checkpointed block: its recomputed forward), whose gradients take the place of what backward consumes; then
    the loss's logits.
    """
    per_block = shape.saved_elements_per_token() * plan.element_bytes
    per_block += 2 * (plan.gathered_sequence - 1) * shape.kv_dim * plan.element_bytes
    kept_per_checkpoint = plan.residual_bytes * shape.d_model
    if plan.keep_attention:
        kept_per_checkpoint += shape.kept_attention_bytes_per_token(plan.element_bytes)
    uncheckpointed = shape.n_layers - plan.checkpointed_blocks
    held = uncheckpointed * per_block + plan.checkpointed_blocks * kept_per_checkpoint
    recomputed = per_block if plan.checkpointed_blocks else 0
    return plan.tokens * (held + recomputed) + logits_bytes(shape, plan)


def logits_bytes(shape: BlockShape, plan: ActivationPlan) -> int:
    """The loss's working memory: chunked logits, the hidden states' gradient and the fp32 output-weight gradient
    (fused), or the whole logits in the compute dtype, their fp32 log-softmax and its gradient (unfused)."""
    if not plan.fused_loss:
        return plan.tokens * shape.vocab_size * (plan.element_bytes + 2 * FP32_BYTES)
    from_chunk = chunk_tokens_for(plan.tokens, shape.vocab_size, plan.element_bytes)
    chunk_logits = from_chunk * shape.vocab_size * plan.element_bytes
    return (
        chunk_logits + plan.tokens * shape.d_model * plan.element_bytes + shape.vocab_size * shape.d_model * FP32_BYTES
    )
