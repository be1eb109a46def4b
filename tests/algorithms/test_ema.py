"""ema averages the weights without changing training, evaluates with the average, and survives checkpoints."""

from __future__ import annotations

import pytest
import torch
from helpers import token_batches

from foundry.algorithms import EMA
from foundry.core import Callback
from foundry.errors import ConfigError


class WeightsAfterEachBatch(Callback):
    """The weights at FIT_START, then after each batch."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []

    def fit_start(self, state, logger) -> None:
        self.batch_end(state, logger)

    def batch_end(self, state, logger) -> None:
        self.weights.append({name: p.detach().clone() for name, p in state.model.named_parameters()})


def test_training_losses_are_unchanged(train):
    _, plain = train()
    _, with_ema = train([EMA(smoothing=0.5)])
    assert with_ema == plain


def test_average_follows_the_smoothing_formula(train):
    recorder = WeightsAfterEachBatch()
    ema = EMA(smoothing=0.5)
    train([ema], callbacks=[recorder], num_batches=3)
    initial, *trained = recorder.weights
    expected = dict(initial)
    for weights in trained:
        expected = {name: 0.5 * expected[name] + 0.5 * weights[name] for name in expected}
    assert ema.num_updates == 3
    assert all(torch.allclose(ema.weights[name], expected[name], atol=1e-6) for name in expected)


def test_half_life_sets_the_smoothing():
    assert EMA(half_life="10ba", update_interval="2ba").smoothing == pytest.approx(0.5 ** (2 / 10))


def test_half_life_and_smoothing_together_is_a_config_error():
    with pytest.raises(ConfigError, match="both half_life and smoothing"):
        EMA(half_life="10ba", smoothing=0.9)


def test_eval_uses_the_average_and_training_weights_come_back(train):
    eval_loader = token_batches(1, batch_size=2, seq_len=16, vocab_size=96, seed=1)
    trainer, _ = train([EMA(smoothing=0.9)], num_batches=2)
    trained = {name: p.detach().clone() for name, p in trainer.state.model.named_parameters()}
    trainer.state.eval_dataloaders = {"eval": eval_loader}
    with_ema = trainer.eval()["eval"]["loss"]
    after = dict(trainer.state.model.named_parameters())
    assert all(torch.equal(trained[name], after[name]) for name in trained)
    trainer.engine.algorithms[0].eval_with_ema = False
    assert trainer.eval()["eval"]["loss"] != with_ema


def test_average_is_restored_from_a_checkpoint(train, tmp_path):
    first = EMA(smoothing=0.5)
    train([first], num_batches=2, save_folder=str(tmp_path / "ckpt"), save_interval="2ba")
    resumed = EMA(smoothing=0.5)
    train([resumed], num_batches=2, load_path=str(tmp_path / "ckpt"))
    assert resumed.num_updates == 2
    assert all(torch.equal(first.weights[name], resumed.weights[name]) for name in first.weights)


def test_swap_at_fit_end_leaves_the_average_in_the_model(train):
    ema = EMA(smoothing=0.5, swap_at_fit_end=True)
    recorder = WeightsAfterEachBatch()
    trainer, _ = train([ema], callbacks=[recorder], num_batches=2)
    name = "transformer.norm_f.weight"
    assert not torch.equal(trainer.state.model.get_parameter(name), recorder.weights[-1][name])
