"""The model's side of ICL scoring: continuation log-likelihoods and whether greedy decoding writes them.

Any ``FoundryModel`` whose ``forward({"input_ids": ...})`` returns logits (MPT, Llama, ``hf_causal_lm``)
or an object with ``.logits`` works. Generation tasks decode with ``foundry.models.generation``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from foundry.models.generation import logits_of


@dataclasses.dataclass
class ContinuationScores:
    """Per row of a batch: how likely its continuation is, and whether greedy decoding writes it."""

    logprob_sum: torch.Tensor  # (rows,) float32: sum over continuation tokens of log p(token | prefix)
    num_tokens: torch.Tensor  # (rows,)
    greedy_match: torch.Tensor  # (rows,) bool: every continuation token is the argmax


@torch.no_grad()
def score_continuations(
    model: nn.Module,
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    continuation_starts: torch.Tensor,
    precision: str = "fp32",
) -> ContinuationScores:
    """Log-likelihood and greedy exact match of tokens ``[continuation_starts, lengths)`` of each row.

    Only the continuation positions' logits are turned into (float32) log-probabilities, so memory
    stays at (continuation tokens, vocab) rather than (rows, seq, vocab).
    """
    logits = logits_of(model, input_ids, precision)
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]  # (1, seq)
    # Position t predicts token t+1: the continuation [start, length) is predicted at [start-1, length-1).
    predicts = (positions >= continuation_starts[:, None] - 1) & (positions < lengths[:, None] - 1)  # (rows, seq)
    rows, columns = predicts.nonzero(as_tuple=True)
    targets = input_ids[rows, columns + 1]
    log_probs = torch.log_softmax(logits[rows, columns].float(), dim=-1)  # (tokens, vocab)
    token_logprob = log_probs.gather(1, targets[:, None]).squeeze(1)
    hit = (log_probs.argmax(dim=-1) == targets).float()
    num_rows = input_ids.shape[0]
    zeros = torch.zeros(num_rows, device=input_ids.device)
    num_tokens = zeros.index_add(0, rows, torch.ones_like(hit))
    return ContinuationScores(
        logprob_sum=zeros.index_add(0, rows, token_logprob),
        num_tokens=num_tokens,
        greedy_match=zeros.index_add(0, rows, hit) == num_tokens,
    )
