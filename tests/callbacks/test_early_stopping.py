"""early_stopper and threshold_stopper: stop at the right eval on a scripted eval curve, loud on a wrong metric."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyLM, token_batches

from foundry.callbacks import EarlyStopper, ThresholdStopper
from foundry.core import Event
from foundry.errors import ConfigError
from foundry.trainer import Trainer


class ScriptedEvalLM(TinyLM):
    """Reports the next scripted eval loss (and accuracy = 1 - loss) at each evaluation."""

    def __init__(self, eval_losses: list[float]) -> None:
        super().__init__()
        self.eval_losses = list(eval_losses)

    def eval_metrics_from_loss(self, loss: float) -> dict[str, float]:
        scripted = self.eval_losses.pop(0) if self.eval_losses else 9.0
        return {"loss": scripted, "accuracy": 1.0 - scripted}


def _fit(tmp_path, eval_losses: list[float], stopper, num_batches: int = 10, **kwargs) -> Trainer:
    kwargs.setdefault("max_duration", f"{num_batches}ba")
    trainer = Trainer(
        model=ScriptedEvalLM(eval_losses),
        train_dataloader=token_batches(num_batches, batch_size=2),
        eval_dataloader=token_batches(1, batch_size=2),
        eval_interval="1ba",
        optimizers=lambda params: torch.optim.SGD(params, lr=0.01),
        callbacks=[stopper],
        log_to_console=False,
        run_folder=str(tmp_path / "run"),
        **kwargs,
    )
    trainer.fit()
    return trainer


def test_early_stopper_stops_after_patience_evals_without_improvement(tmp_path):
    trainer = _fit(tmp_path, [3.0, 2.0, 2.5, 2.4, 1.0], EarlyStopper(patience=2))
    assert trainer.state.timestamp.batch == 4
    assert "metrics/eval/loss has not improved" in trainer.state.stop_reason
    assert "best 2.0000 at batch 2" in trainer.state.stop_reason


def test_improvements_smaller_than_min_delta_do_not_count(tmp_path):
    trainer = _fit(tmp_path, [3.0, 2.95, 2.9, 1.0], EarlyStopper(patience=2, min_delta=0.1))
    assert trainer.state.timestamp.batch == 3


def test_patience_as_time_counts_batches_since_the_best_eval(tmp_path):
    trainer = _fit(tmp_path, [2.0, 2.0, 2.0, 2.0], EarlyStopper(patience="3ba"))
    assert trainer.state.timestamp.batch == 4


def test_composer_form_with_auto_max_for_accuracy(tmp_path):
    stopper = EarlyStopper(monitor="accuracy", dataloader_label="eval", patience=1)
    trainer = _fit(tmp_path, [0.9, 0.5, 0.6, 0.6], stopper)  # accuracy 0.1, 0.5, 0.4: stops at the drop
    assert stopper.key == "metrics/eval/accuracy"
    assert trainer.state.timestamp.batch == 3


def test_no_stop_while_the_metric_keeps_improving(tmp_path):
    trainer = _fit(tmp_path, [5.0, 4.0, 3.0, 2.0], EarlyStopper(patience=1), num_batches=4)
    assert trainer.state.stop_reason is None
    assert trainer.state.timestamp.batch == 4


def test_unknown_metric_at_first_eval_lists_the_available_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"metrics/eval/los' .*Available: metrics/eval/loss, metrics/eval/accuracy"):
        _fit(tmp_path, [1.0], EarlyStopper(monitor="metrics/eval/los"))


def test_unknown_eval_label_is_a_config_error_at_fit_start(tmp_path):
    with pytest.raises(ConfigError, match=r"no eval loader labelled 'val' \(eval loaders: eval\)"):
        _fit(tmp_path, [1.0], EarlyStopper(monitor="loss", dataloader_label="val"))


def test_monitor_key_and_dataloader_label_must_agree():
    with pytest.raises(ConfigError, match="dataloader_label"):
        EarlyStopper(monitor="metrics/eval/loss", dataloader_label="val")


def test_another_loaders_eval_end_is_not_an_eval_of_the_watched_one(state, fire):
    state.eval_dataloaders = {"a": [], "b": []}
    stopper = EarlyStopper(monitor="metrics/a/loss", patience=1)
    fire(stopper, Event.FIT_START)
    state.eval_metrics["a"] = {"loss": 1.0}
    fire(stopper, Event.EVAL_END)
    state.eval_metrics["b"] = {"loss": 5.0}
    fire(stopper, Event.EVAL_END)
    assert (stopper.evals_since_best, state.stop_reason) == (0, None)


def test_early_stopper_state_survives_a_checkpoint_round_trip(state, fire):
    state.eval_dataloaders = {"eval": []}
    stopper = EarlyStopper(patience=3)
    state.eval_metrics["eval"] = {"loss": 2.0}
    fire(stopper, Event.EVAL_END)
    resumed = EarlyStopper(patience=3)
    resumed.load_state_dict(stopper.state_dict())
    assert (resumed.best, resumed.evals_since_best) == (2.0, 0)


def test_threshold_stopper_stops_once_the_loss_goes_below(tmp_path):
    trainer = _fit(tmp_path, [3.0, 2.6, 2.4, 2.0], ThresholdStopper(monitor="metrics/eval/loss", threshold=2.5))
    assert trainer.state.timestamp.batch == 3
    assert "below the threshold 2.5" in trainer.state.stop_reason


def test_threshold_stopper_without_stop_on_batch_finishes_the_epoch(tmp_path):
    stopper = ThresholdStopper(monitor="loss", threshold=2.5, stop_on_batch=False)
    trainer = _fit(tmp_path, [3.0, 2.0, 2.0, 2.0, 2.0], stopper, num_batches=3, max_duration="3ep")
    assert trainer.state.timestamp.batch == 3
    assert trainer.state.timestamp.epoch == 1


@pytest.mark.parametrize("patience", [0, "0ba", "soon"])
def test_bad_patience_is_a_config_error(patience):
    with pytest.raises(ConfigError, match="patience"):
        EarlyStopper(patience=patience)
