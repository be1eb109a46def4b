"""Training time in the units users think in: epochs, batches, samples, tokens, or a fraction of the run.

``Time.parse("100ba")`` is 100 batches, ``"2ep"`` two epochs, ``"5000tok"`` 5000 tokens,
``"64sp"`` 64 samples and ``"0.25dur"`` a quarter of ``max_duration``. A ``Timestamp`` is the
run's position in every unit at once, so any ``Time`` can be compared against it.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

from foundry.errors import ConfigError

# Wall-clock units a person reads (the runtime estimate's `time_unit`), in seconds.
SECONDS_PER_UNIT: dict[str, float] = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}


class TimeUnit(str, enum.Enum):
    EPOCH = "ep"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"
    DURATION = "dur"


_TIME_PATTERN = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ep|ba|sp|tok|dur)\s*$")


@dataclasses.dataclass(frozen=True, order=False)
class Time:
    """An amount of training time: a value and its unit. Integers except for ``dur``."""

    value: int | float
    unit: TimeUnit

    def __post_init__(self) -> None:
        unit = TimeUnit(self.unit)
        object.__setattr__(self, "unit", unit)
        if unit != TimeUnit.DURATION:
            if float(self.value) != int(self.value):
                raise ConfigError(
                    f"Time {self.value}{unit.value} must be a whole number of {unit.name.lower()}s; "
                    "only 'dur' takes fractions (e.g. '0.25dur')."
                )
            object.__setattr__(self, "value", int(self.value))
        if self.value < 0:
            raise ConfigError(f"Time {self.value}{unit.value} is negative; durations must be >= 0.")

    @classmethod
    def parse(cls, text: str | int | Time) -> Time:
        """Parse ``"100ba"``-style strings; a bare integer means batches."""
        if isinstance(text, Time):
            return text
        if isinstance(text, bool):
            raise ConfigError(f"Cannot read {text!r} as a time; write e.g. '100ba', '2ep', '5000tok'.")
        if isinstance(text, int):
            return cls(text, TimeUnit.BATCH)
        match = _TIME_PATTERN.match(str(text))
        if not match:
            raise ConfigError(
                f"Cannot read {text!r} as a time. Write a number and a unit: 'ep' (epochs), 'ba' (batches), "
                "'sp' (samples), 'tok' (tokens) or 'dur' (fraction of max_duration), e.g. '100ba' or '0.25dur'."
            )
        value, unit = match.groups()
        number = float(value)
        return cls(number, TimeUnit(unit))

    def __str__(self) -> str:
        return f"{self.value}{self.unit.value}"

    def _check_same_unit(self, other: Time) -> None:
        if self.unit != other.unit:
            raise ValueError(f"Cannot combine {self} and {other}: units differ.")

    def __add__(self, other: Time) -> Time:
        self._check_same_unit(other)
        return Time(self.value + other.value, self.unit)

    def __sub__(self, other: Time) -> Time:
        self._check_same_unit(other)
        return Time(self.value - other.value, self.unit)

    def __mul__(self, factor: int | float) -> Time:
        return Time(self.value * factor if self.unit == TimeUnit.DURATION else int(self.value * factor), self.unit)

    def __lt__(self, other: Time) -> bool:
        self._check_same_unit(other)
        return self.value < other.value

    def __le__(self, other: Time) -> bool:
        self._check_same_unit(other)
        return self.value <= other.value

    def __gt__(self, other: Time) -> bool:
        self._check_same_unit(other)
        return self.value > other.value

    def __ge__(self, other: Time) -> bool:
        self._check_same_unit(other)
        return self.value >= other.value


def _counter_field() -> Any:
    return dataclasses.field(default=0)


@dataclasses.dataclass
class Timestamp:
    """Where the run is, in every unit, plus wall-clock seconds spent training."""

    epoch: int = _counter_field()
    batch: int = _counter_field()
    sample: int = _counter_field()
    token: int = _counter_field()
    batch_in_epoch: int = _counter_field()
    sample_in_epoch: int = _counter_field()
    token_in_epoch: int = _counter_field()
    total_wct_s: float = 0.0
    epoch_wct_s: float = 0.0
    batch_wct_s: float = 0.0

    def get(self, unit: TimeUnit | str) -> int:
        """The count in ``unit``; ``dur`` is relative and needs ``State.progress`` instead."""
        unit = TimeUnit(unit)
        if unit == TimeUnit.DURATION:
            raise ValueError("A timestamp has no absolute 'dur' count; use State.progress.")
        return {
            TimeUnit.EPOCH: self.epoch,
            TimeUnit.BATCH: self.batch,
            TimeUnit.SAMPLE: self.sample,
            TimeUnit.TOKEN: self.token,
        }[unit]

    def after_batch(self, samples: int, tokens: int, duration_s: float) -> Timestamp:
        """The timestamp once a batch of ``samples`` and ``tokens`` has trained."""
        return dataclasses.replace(
            self,
            batch=self.batch + 1,
            sample=self.sample + samples,
            token=self.token + tokens,
            batch_in_epoch=self.batch_in_epoch + 1,
            sample_in_epoch=self.sample_in_epoch + samples,
            token_in_epoch=self.token_in_epoch + tokens,
            total_wct_s=self.total_wct_s + duration_s,
            epoch_wct_s=self.epoch_wct_s + duration_s,
            batch_wct_s=duration_s,
        )

    def after_epoch(self) -> Timestamp:
        """The timestamp once an epoch has ended: in-epoch counters restart."""
        return dataclasses.replace(
            self, epoch=self.epoch + 1, batch_in_epoch=0, sample_in_epoch=0, token_in_epoch=0, epoch_wct_s=0.0
        )

    def state_dict(self) -> dict[str, int | float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, int | float]) -> Timestamp:
        return cls(**state)


# What to write instead of a zero time, for each key that takes one.
_INSTEAD_OF_ZERO = {
    "max_duration": "Set how long to train, e.g. '100ba' or '1ep'.",
    "eval_interval": "To evaluate only once training ends, set it to '1dur'.",
    "save_interval": "To checkpoint only once training ends, set it to '1dur'; without save_folder nothing is saved.",
    "console_log_interval": "To print metrics less often, give a longer interval, e.g. '100ba'.",
}


def looks_like_time(value: object) -> bool:
    """Whether ``value`` is written as a time (``"-5ba"``, ``"0.25dur"``, ``100``), right or wrong."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, str) and _TIME_PATTERN.match(value) is not None)


def positive_time(value: str | int | Time, key: str) -> Time:
    """``Time.parse(value)``, refusing zero: a run that never trains, an interval that never comes."""
    time = Time.parse(value)
    if time.value <= 0:
        raise ConfigError(f"'{key}' is {time}; it must be more than 0. {_INSTEAD_OF_ZERO.get(key, '')}".rstrip())
    return time
