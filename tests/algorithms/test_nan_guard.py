"""NanGuard: stops at the exact bad batch before any weight moves, skips when asked, flags loss spikes."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from helpers import TinyLM, token_batches

from foundry.algorithms import NanGuard
from foundry.checkpoint import load_checkpoint
from foundry.core import Callback, Event, State, Time
from foundry.errors import ConfigError, TrainingError
from foundry.trainer import Trainer

POISON = 31  # a token id the clean batches never hold


class PoisonableLM(TinyLM):
    """TinyLM whose logits turn NaN wherever the input holds POISON."""

    def forward(self, batch: dict) -> torch.Tensor:
        logits = super().forward(batch)  # (batch, seq, vocab)
        return logits.masked_fill((batch["input_ids"] == POISON).unsqueeze(-1), float("nan"))


def _batches(num_batches: int, poisoned: tuple[int, ...] = ()) -> list:
    """Clean batches, with POISON in each batch numbered (from 1) in ``poisoned``."""
    batches = token_batches(num_batches, batch_size=2, vocab_size=POISON)
    for number in poisoned:
        batches[number - 1]["input_ids"][0, 0] = POISON
    return batches


def _trainer(tmp_path, batches: list, guard: NanGuard, **kwargs) -> Trainer:
    return Trainer(
        model=PoisonableLM(),
        train_dataloader=batches,
        max_duration=f"{len(batches)}ba",
        optimizers=lambda params: torch.optim.SGD(params, lr=0.1),
        algorithms=[guard],
        log_to_console=False,
        run_folder=str(tmp_path / "run"),
        **kwargs,
    )


def _all_finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_stop_mode_raises_at_the_poisoned_batch(tmp_path):
    trainer = _trainer(tmp_path, _batches(6, poisoned=(4,)), NanGuard())
    with pytest.raises(TrainingError, match=r"loss became non-finite at batch 4 \(loss nan"):
        trainer.fit()
    assert trainer.state.timestamp.batch == 3
    assert _all_finite(trainer.state.model)


def test_stop_leaves_only_earlier_checkpoints_with_finite_weights(tmp_path):
    save_folder = tmp_path / "checkpoints"
    trainer = _trainer(
        tmp_path, _batches(5, poisoned=(3,)), NanGuard(), save_folder=str(save_folder), save_interval="1ba"
    )
    with pytest.raises(TrainingError, match="batch 3"):
        trainer.fit()
    saved = sorted(path.name for path in save_folder.iterdir() if path.is_dir())
    assert saved == ["ep0-ba1", "ep0-ba2"]
    for name in saved:
        state = State(model=PoisonableLM(), max_duration=Time.parse("1ba"))
        load_checkpoint(save_folder / name, state, weights_only=True)
        assert _all_finite(state.model)


def test_non_finite_gradients_with_a_finite_loss_name_the_gradients(tmp_path):
    class InfGradAtBatchTwo(Callback):
        def after_backward(self, state, logger):
            if state.timestamp.batch + 1 == 2:
                next(state.model.parameters()).grad[0, 0] = float("inf")

    trainer = _trainer(tmp_path, _batches(4), NanGuard())
    trainer.engine.callbacks.insert(0, InfGradAtBatchTwo())
    with pytest.raises(TrainingError, match=r"gradients \(the loss is finite\) became non-finite at batch 2"):
        trainer.fit()


def test_skip_mode_drops_the_bad_batch_and_keeps_weights_finite(tmp_path, recorder):
    trainer = _trainer(tmp_path, _batches(4, poisoned=(2,)), NanGuard(mode="skip"), loggers=[recorder])
    with pytest.warns(UserWarning, match="skipped batch 2"):
        trainer.fit()
    assert trainer.state.timestamp.batch == 4
    assert _all_finite(trainer.state.model)
    assert [(m["health/skipped_batches"], step) for m, step in recorder.calls if "health/skipped_batches" in m] == [
        (1.0, 2)
    ]


def test_skip_mode_stops_after_max_consecutive_skips(tmp_path):
    guard = NanGuard(mode="skip", max_skipped_batches=2)
    trainer = _trainer(tmp_path, _batches(6, poisoned=(2, 3, 4)), guard)
    with pytest.warns(UserWarning), pytest.raises(TrainingError, match="at batch 4 after 2 skipped batches"):
        trainer.fit()
    assert guard.skipped_batches == 2


def _loss_step(guard: NanGuard, fire, state: State, loss: float) -> None:
    state.loss = torch.tensor(loss)
    fire(guard, Event.BEFORE_OPTIMIZER_STEP)
    state.timestamp = state.timestamp.after_batch(1, 1, 0.0)


def test_spike_warning_fires_on_a_jump_above_factor_times_the_recent_mean(state, fire, recorder):
    guard = NanGuard(check_grads=False, spike_factor=2.0, spike_window=3)
    for loss in (1.0, 1.2, 0.8):
        _loss_step(guard, fire, state, loss)
    with pytest.warns(UserWarning, match=r"loss spike at batch 4: 2.5000 is 2.5x the mean"):
        _loss_step(guard, fire, state, 2.5)
    assert recorder.last("health/loss_spikes") == 1.0


def test_spike_warning_stays_silent_on_a_smooth_noisy_curve(state, fire):
    guard = NanGuard(check_grads=False, spike_factor=2.0, spike_window=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(20):
            _loss_step(guard, fire, state, 10.0 * math.exp(-0.2 * step) * (1.3 if step % 2 else 0.8))


def test_grad_norm_from_gradient_clipping_is_reused(state, fire):
    state.grad_norm = torch.tensor(float("inf"))  # as gradient_clipping sets it
    state.loss = torch.tensor(1.0)
    with pytest.raises(TrainingError, match="gradients"):
        fire(NanGuard(), Event.BEFORE_OPTIMIZER_STEP)


def test_amp_fp16_leaves_inf_gradients_to_the_grad_scaler(state, fire):
    state.precision = "amp_fp16"
    state.loss = torch.tensor(1.0)
    state.model.linear.weight.grad = torch.full((2, 2), float("inf"))
    fire(NanGuard(), Event.BEFORE_OPTIMIZER_STEP)
    assert not state.skip_optimizer_step


def test_one_host_read_per_batch(state, fire, host_reads):
    state.loss = torch.tensor(1.0)
    state.model.linear.weight.grad = torch.ones(2, 2)
    fire(NanGuard(), Event.BEFORE_OPTIMIZER_STEP)
    assert host_reads == ["tolist"]


def test_counters_and_recent_losses_survive_a_checkpoint_round_trip():
    guard = NanGuard(spike_window=3)
    guard.skipped_batches = 2
    guard.recent_losses.extend([1.0, 2.0])
    resumed = NanGuard(spike_window=3)
    resumed.load_state_dict(guard.state_dict())
    assert (resumed.skipped_batches, list(resumed.recent_losses)) == (2, [1.0, 2.0])


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"mode": "ignore"}, "mode"),
        ({"spike_factor": 0.5}, "spike_factor"),
        ({"max_skipped_batches": 0}, "max_skipped"),
    ],
)
def test_bad_settings_are_config_errors(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        NanGuard(**kwargs)
