"""Preference losses over per-pair log-probabilities, as TRL computes them (``DPOTrainer``, ``CPOTrainer``).

Each takes the policy's (and, where it has one, the reference's) log-probability of the chosen and of the
rejected response, one value per pair, and returns the per-pair loss (pairs,) and the per-pair rewards whose
means TRL logs as ``rewards/chosen`` and ``rewards/rejected``:

- ``sigmoid`` (DPO, Rafailov et al. 2023): ``-log σ(β·h)`` with ``h = (π_c − π_r) − (ref_c − ref_r)``, and with
  ``label_smoothing`` ε the conservative DPO mix ``−(1−ε)·log σ(β·h) − ε·log σ(−β·h)``;
- ``ipo`` (Azar et al. 2023): ``(h − 1/(2β))²`` over log-probabilities averaged per token;
- ``simpo`` (Meng et al. 2024): reference-free, ``−log σ(β·(π̄_c − π̄_r) − γ)`` over log-probabilities averaged per
  token, with the margin ``γ = gamma_beta_ratio · β`` (label smoothing mixes as for ``sigmoid``).

Rewards are ``β·(π − ref)`` for DPO and IPO and ``β·π̄`` for SimPO.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from foundry.preference.config import LOSS_TYPES, LossType


def preference_loss(
    loss_type: LossType,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    reference_chosen: torch.Tensor | None,
    reference_rejected: torch.Tensor | None,
    beta: float,
    label_smoothing: float = 0.0,
    gamma_beta_ratio: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, chosen reward, rejected reward), each (pairs,); log-probabilities are (pairs,) float32."""
    if loss_type == "simpo":
        logits = chosen - rejected - gamma_beta_ratio
        return _smoothed_sigmoid(beta * logits, label_smoothing), beta * chosen.detach(), beta * rejected.detach()
    chosen_ratio = chosen - reference_chosen
    rejected_ratio = rejected - reference_rejected
    logits = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        loss = _smoothed_sigmoid(beta * logits, label_smoothing)
    elif loss_type == "ipo":
        loss = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {loss_type!r}; known: {', '.join(LOSS_TYPES)}")
    return loss, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def _smoothed_sigmoid(scaled_logits: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(scaled_logits) * (1 - label_smoothing) - F.logsigmoid(-scaled_logits) * label_smoothing
