"""Each sequence's summed log-probability of its labelled tokens, as the preference losses read them.

A model that computes them itself (``CausalLM.computes_token_logps``: MPT and Llama) runs its output projection
chunk by chunk with the fused cross-entropy kernel the SFT loss uses, so the (rows, seq, vocab) logits never exist;
any other (``hf_causal_lm``) returns logits, and the log-probabilities are taken from them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from foundry.batches import IGNORE_INDEX


def model_sequence_logps(
    model: nn.Module,
    inputs: Mapping[str, Any],
    labels: torch.Tensor,
    sequence_id: torch.Tensor | None = None,
    sequences: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence_logps`` of ``model``'s forward on ``inputs`` (rows, seq): chunked where the model can."""
    if not getattr(model, "computes_token_logps", False):
        return sequence_logps(model(inputs), labels, sequence_id, sequences=sequences)
    token_logps = model({**inputs, "labels": labels}, token_logps=True).logps  # (rows, seq): t predicts t+1
    return _summed_per_sequence(token_logps[:, :-1], labels, sequence_id, sequences)


def sequence_logps(
    logits: torch.Tensor,
    labels: torch.Tensor,
    sequence_id: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    sequences: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its labelled tokens, and how many it has: ((rows, k), (rows, k)).

    ``logits`` (rows, seq, vocab) at position t predict ``labels`` at t+1; positions labelled ``ignore_index``
    (the prompt, padding) add nothing. A row holds one sequence (k = 1), or with ``sequence_id`` (rows, seq)
    the k packed ones it numbers 0..k-1 (-1 on padding); ``sequences`` sets k (no host sync to find it; a
    column past a row's last sequence has count 0). Computed in float32 as cross-entropy, without a
    (rows, seq, vocab) copy.
    """
    targets = labels[:, 1:]
    token_logps = -F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=ignore_index, reduction="none"
    ).view(targets.shape)
    return _summed_per_sequence(token_logps, labels, sequence_id, sequences, ignore_index)


def _summed_per_sequence(
    token_logps: torch.Tensor,
    labels: torch.Tensor,
    sequence_id: torch.Tensor | None = None,
    sequences: int | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_logps`` (rows, seq - 1), each of ``labels[:, 1:]``'s token (0 where ignored), summed per sequence."""
    labelled = labels[:, 1:] != ignore_index
    if sequence_id is None:
        return token_logps.sum(-1, keepdim=True), labelled.sum(-1, keepdim=True)
    segment = sequence_id[:, 1:].clamp(min=0)  # a target's sequence is its token's; padding is unlabelled
    if sequences is None:
        sequences = int(sequence_id.max()) + 1
    sums = token_logps.new_zeros(len(labels), sequences).scatter_add(1, segment, token_logps)
    counts = labelled.new_zeros(len(labels), sequences, dtype=torch.int64).scatter_add(1, segment, labelled.long())
    return sums, counts
