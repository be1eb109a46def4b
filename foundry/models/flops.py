"""Model FLOPs of a decoder-only transformer, by LLM Foundry's MFU formula so MFU numbers compare.

For a batch of ``batch_size`` sequences of ``seq_len`` tokens (``ComposerMPTCausalLM.flops_per_batch``):

    flops = 3 * batch_size * (2 * n_active_params * seq_len + n_layers * 2 * 2 * q_dim * seq_len**2)

- ``2 * n_active_params`` per token: one multiply and one add per weight in the forward pass.
- ``n_layers * 2 * 2 * q_dim * seq_len**2`` per sequence: QK^T and attention-weights @ V, each
  ``2 * seq_len**2 * q_dim`` per layer, counted over the full (unmasked) square, as LLM Foundry does
  (no causal or sliding-window discount).
- ``3``: backward costs about twice the forward.
- Padding is counted as real tokens.
- ``q_dim`` is the width of q, heads × head_dim: LLM Foundry's ``d_model``, unless ``head_dim`` sets
  another (Qwen3's 32 heads of 128 over d_model 2048 attend over 4096).

``n_active_params`` is LLM Foundry's ``mpt_get_active_params``: every parameter once (tied
embeddings are one parameter), minus the token embedding when it is *not* tied, because a lookup
table costs no FLOPs; a tied embedding stays counted since it is also the output projection. The
learned position embedding (``wpe``) stays counted, as in LLM Foundry. A mixture-of-experts model
subtracts the experts a token does not use (``MoE.inactive_params``): MFU is that of active parameters.
"""

from __future__ import annotations

import torch
from torch import nn


def num_params(model: nn.Module) -> int:
    """Parameters of ``model``, each shared (tied) parameter once."""
    return sum(p.numel() for p in model.parameters())


def active_params(model: nn.Module, token_embedding: nn.Embedding, tie_word_embeddings: bool) -> int:
    """Parameters that cost FLOPs per token (see the module docstring)."""
    params = num_params(model)
    return params if tie_word_embeddings else params - token_embedding.weight.numel()


def flops_per_batch(n_active_params: int, n_layers: int, q_dim: int, batch_size: int, seq_len: int) -> int:
    """Forward + backward FLOPs of one batch."""
    params_flops_per_seq = 2 * n_active_params * seq_len
    attention_flops_per_seq = n_layers * 2 * 2 * q_dim * seq_len**2
    return 3 * batch_size * (params_flops_per_seq + attention_flops_per_seq)


def rows_and_length(input_ids: torch.Tensor) -> tuple[int, int]:
    """Sequences and their length in a batch's ``input_ids``: ``(batch, seq)``, or a preference batch's
    ``(pairs, 2, seq)``, whose chosen and rejected rows both run through the model."""
    seq_len = input_ids.shape[-1]
    return input_ids.numel() // max(seq_len, 1), seq_len


def flops_per_token(n_active_params: int, n_layers: int, q_dim: int, seq_len: int) -> int:
    """Forward + backward FLOPs per token of a ``seq_len``-token sequence (``flops_per_batch / tokens``)."""
    return 3 * (2 * n_active_params + n_layers * 2 * 2 * q_dim * seq_len)
