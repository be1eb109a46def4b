"""Each preference loss against its formula, written out with math on a few numbers."""

from __future__ import annotations

import math

import pytest
import torch

from foundry.preference.losses import preference_loss

CHOSEN, REJECTED = torch.tensor([-3.0, -7.5]), torch.tensor([-4.0, -6.0])
REFERENCE_CHOSEN, REFERENCE_REJECTED = torch.tensor([-3.5, -7.0]), torch.tensor([-3.0, -6.5])


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def margins() -> list[float]:
    """h = (π_c − π_r) − (ref_c − ref_r) per pair."""
    return [
        (c - r) - (rc - rr)
        for c, r, rc, rr in zip(
            CHOSEN.tolist(), REJECTED.tolist(), REFERENCE_CHOSEN.tolist(), REFERENCE_REJECTED.tolist()
        )
    ]


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_sigmoid_is_dpo_with_conservative_label_smoothing(label_smoothing: float) -> None:
    beta = 0.1
    loss, chosen_reward, rejected_reward = preference_loss(
        "sigmoid", CHOSEN, REJECTED, REFERENCE_CHOSEN, REFERENCE_REJECTED, beta, label_smoothing
    )
    expected = [
        -(1 - label_smoothing) * log_sigmoid(beta * h) - label_smoothing * log_sigmoid(-beta * h) for h in margins()
    ]
    assert loss.tolist() == pytest.approx(expected, rel=1e-6)
    assert chosen_reward.tolist() == pytest.approx((beta * (CHOSEN - REFERENCE_CHOSEN)).tolist())
    assert rejected_reward.tolist() == pytest.approx((beta * (REJECTED - REFERENCE_REJECTED)).tolist())


def test_ipo_is_the_squared_distance_of_the_margin_from_one_over_two_beta() -> None:
    beta = 0.5
    loss, _, _ = preference_loss("ipo", CHOSEN, REJECTED, REFERENCE_CHOSEN, REFERENCE_REJECTED, beta)
    assert loss.tolist() == pytest.approx([(h - 1 / (2 * beta)) ** 2 for h in margins()], rel=1e-6)


def test_simpo_needs_no_reference_and_subtracts_its_margin_gamma() -> None:
    beta, gamma_beta_ratio = 2.0, 0.5
    loss, chosen_reward, _ = preference_loss("simpo", CHOSEN, REJECTED, None, None, beta, 0.0, gamma_beta_ratio)
    expected = [-log_sigmoid(beta * (c - r - gamma_beta_ratio)) for c, r in zip(CHOSEN.tolist(), REJECTED.tolist())]
    assert loss.tolist() == pytest.approx(expected, rel=1e-6)
    assert chosen_reward.tolist() == pytest.approx((beta * CHOSEN).tolist())
