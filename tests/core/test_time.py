import pytest
import torch

from foundry.core import State, Time, Timestamp, TimeUnit
from foundry.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "value", "unit"),
    [
        ("100ba", 100, TimeUnit.BATCH),
        ("2ep", 2, TimeUnit.EPOCH),
        ("5000tok", 5000, TimeUnit.TOKEN),
        ("64sp", 64, TimeUnit.SAMPLE),
        ("0.25dur", 0.25, TimeUnit.DURATION),
        (" 3 ba ", 3, TimeUnit.BATCH),
        (7, 7, TimeUnit.BATCH),
        ("1e3tok", 1000, TimeUnit.TOKEN),
    ],
)
def test_parse_reads_value_and_unit(text, value, unit):
    time = Time.parse(text)
    assert (time.value, time.unit) == (value, unit)


@pytest.mark.parametrize("text", ["100", "ba", "1.5ba", "-2ep", "10 batches", True])
def test_parse_rejects_bad_times_with_a_hint(text):
    with pytest.raises(ConfigError, match="ba|whole|negative"):
        Time.parse(text)


def test_arithmetic_and_comparison_within_a_unit():
    assert Time.parse("3ba") + Time.parse("4ba") == Time.parse("7ba")
    assert Time.parse("10ba") - Time.parse("4ba") == Time.parse("6ba")
    assert Time.parse("10ba") * 3 == Time.parse("30ba")
    assert Time.parse("0.5dur") * 0.5 == Time.parse("0.25dur")
    assert Time.parse("3ba") < Time.parse("4ba") <= Time.parse("4ba")
    assert str(Time.parse("12tok")) == "12tok"


def test_mixing_units_is_an_error():
    with pytest.raises(ValueError, match="units differ"):
        Time.parse("3ba") + Time.parse("1ep")


def test_timestamp_tracks_every_unit_and_resets_in_epoch_counters():
    stamp = Timestamp().after_batch(samples=4, tokens=32, duration_s=0.5).after_batch(4, 32, 0.25)
    assert (stamp.batch, stamp.sample, stamp.token, stamp.batch_in_epoch) == (2, 8, 64, 2)
    assert stamp.total_wct_s == pytest.approx(0.75) and stamp.batch_wct_s == pytest.approx(0.25)
    stamp = stamp.after_epoch()
    assert (stamp.epoch, stamp.batch_in_epoch, stamp.sample_in_epoch, stamp.token, stamp.epoch_wct_s) == (
        1,
        0,
        0,
        64,
        0,
    )
    assert Timestamp.from_state_dict(stamp.state_dict()) == stamp


def test_state_progress_and_duration_conversion():
    state = State(model=torch.nn.Linear(1, 1), max_duration=Time.parse("200ba"))
    state.timestamp = Timestamp(batch=50)
    assert state.progress == 0.25
    assert state.to_absolute(Time.parse("0.1dur")) == Time.parse("20ba")
    assert state.reached(Time.parse("50ba")) and not state.reached(Time.parse("51ba"))
    assert state.reached(Time.parse("0.25dur"))


def test_epoch_progress_uses_batches_within_the_epoch():
    state = State(model=torch.nn.Linear(1, 1), max_duration=Time.parse("2ep"), train_dataloader_len=10)
    state.timestamp = Timestamp(epoch=1, batch=15, batch_in_epoch=5)
    assert state.progress == pytest.approx(0.75)


def test_crossed_multiple_for_token_intervals():
    state = State(model=torch.nn.Linear(1, 1), max_duration=Time.parse("100ba"))
    before = Timestamp(token=900)
    state.timestamp = before.after_batch(samples=1, tokens=200, duration_s=0.0)
    assert state.crossed_multiple(Time.parse("1000tok"), before)
    assert not state.crossed_multiple(Time.parse("5000tok"), before)
