"""reference_curve: the live train loss against a reference run's, by tokens; a warning or a stop at the batch."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from foundry.callbacks import ReferenceCurve
from foundry.core import Event
from foundry.errors import ConfigError

TOKENS_PER_BATCH = 64


def reference_run(tmp_path: Path, batches: int = 20) -> Path:
    rows = [{"step": step, "loss/train/total": 5.0 - 0.1 * step, "trainer/tokens": step * TOKENS_PER_BATCH}
            for step in range(1, batches + 1)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return tmp_path


def train(callback: ReferenceCurve, state, fire, losses: list[float]) -> None:
    for loss in losses:
        fire(callback, Event.BATCH_START)
        state.timestamp = state.timestamp.after_batch(4, TOKENS_PER_BATCH, 0.1)
        state.loss = torch.tensor(loss)
        fire(callback, Event.BATCH_END)


def on_reference(batches: range) -> list[float]:
    return [5.0 - 0.1 * step for step in batches]


def test_a_run_on_the_reference_curve_is_silent(tmp_path, state, fire, recorder) -> None:
    callback = ReferenceCurve(str(reference_run(tmp_path)), tolerance=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(callback, state, fire, on_reference(range(1, 11)))
    assert callback.excursions == [] and recorder.last("reference/abs_diff") == pytest.approx(0.0, abs=1e-6)


def test_it_warns_at_the_batch_that_leaves_the_band_and_once_per_excursion(tmp_path, state, fire) -> None:
    callback = ReferenceCurve(str(reference_run(tmp_path)), tolerance=0.05)
    losses = on_reference(range(1, 11))
    losses[6] += 0.2  # batch 7
    losses[7] += 0.2  # batch 8: still outside, no second warning
    with pytest.warns(UserWarning, match=r"at batch 7 \(448 tokens\) the train loss 4\.5000 is 0\.2000 from") as caught:
        train(callback, state, fire, losses)
    assert len(caught) == 1 and callback.excursions == [7]


def test_stop_ends_the_run_at_that_batch(tmp_path, state, fire) -> None:
    callback = ReferenceCurve(str(reference_run(tmp_path)), tolerance=0.05, action="stop")
    losses = on_reference(range(1, 6))
    losses[3] = float("nan")  # batch 4
    train(callback, state, fire, losses[:4])
    assert state.stop_reason is not None and "at batch 4" in state.stop_reason


def test_batches_past_the_reference_are_not_checked(tmp_path, state, fire) -> None:
    callback = ReferenceCurve(str(reference_run(tmp_path, batches=3)), tolerance=0.05)
    train(callback, state, fire, [*on_reference(range(1, 4)), 100.0])
    assert callback.excursions == []


def test_a_reference_without_a_train_loss_is_a_config_error(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "metrics/eval/loss": 3.0, "trainer/tokens": 64}\n')
    with pytest.raises(ConfigError, match=r"reference_curve.reference.*holds no loss/train/total"):
        ReferenceCurve(str(tmp_path))


def test_a_missing_reference_is_a_config_error_naming_the_key(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"callbacks\.reference_curve\.reference: .*does not exist"):
        ReferenceCurve(str(tmp_path / "nowhere"))
