"""Training progress in explicit units, so a duration like "10ep" can never be mistaken for 10 batches."""

from __future__ import annotations

import logging
import re
from enum import Enum
from typing import Any, Generic, TypeVar

from state.exceptions import StateError
from state.serializable import Serializable

logger = logging.getLogger(__name__)

TValue = TypeVar("TValue", int, float)


class TimeUnit(Enum):
    """The units a training duration can be given in; the values are the timestring suffixes."""

    EPOCH = "ep"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"
    DURATION = "dur"

    @classmethod
    def _missing_(cls, value: object) -> TimeUnit:
        # Case-insensitive on purpose ("10EP" from a CLI flag), but anything else gets a message that
        # lists the valid suffixes instead of Enum's bare "is not a valid TimeUnit".
        if isinstance(value, str):
            for unit in cls:
                if unit.value == value.strip().lower():
                    return unit
        raise ValueError(f"invalid time unit {value!r}; valid units: {_VALID_UNITS}")


_VALID_UNITS = ", ".join(unit.value for unit in TimeUnit)
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_TIMESTRING = re.compile(rf"^\s*(?P<value>{_NUMBER})\s*(?P<unit>[A-Za-z]+)\s*$")

Number = int | float


def _is_number(value: object) -> bool:
    # bool is an int subclass, but `Time(True, "ep")` is always a bug.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Time(Generic[TValue]):
    """An immutable amount of training time: a value and the unit it is counted in.

    Arithmetic and ordering refuse to mix units, because "5ep + 100ba" has no meaning without knowing the
    dataset size, and guessing it is how schedules silently go wrong.
    """

    __slots__ = ("_value", "_unit")

    def __init__(self, value: TValue, unit: TimeUnit | str) -> None:
        if not _is_number(value):
            raise TypeError(f"Time value must be an int or float, got {type(value).__name__}: {value!r}")
        self._value: TValue = value
        self._unit = TimeUnit(unit)

    @property
    def value(self) -> TValue:
        return self._value

    @property
    def unit(self) -> TimeUnit:
        return self._unit

    @classmethod
    def from_timestring(cls, timestring: str) -> Time[Any]:
        """Parse "10ep", "500ba", "2048sp", "1e6tok" or "0.5dur" (the form CLI flags and configs use)."""
        if not isinstance(timestring, str):
            raise TypeError(f"a time string must be a str, got {type(timestring).__name__}: {timestring!r}")
        match = _TIMESTRING.match(timestring)
        unit: TimeUnit | None = None
        if match is not None:
            try:
                unit = TimeUnit(match["unit"])
            except ValueError:
                unit = None
        if match is None or unit is None:
            raise ValueError(
                f"invalid time string {timestring!r}: expected a non-negative number followed by a unit "
                f"(one of {_VALID_UNITS}), e.g. '10ep', '500ba', '1e6tok' or '0.5dur'"
            )
        text = match["value"]
        if unit is TimeUnit.DURATION:
            return Time(float(text), unit)
        if text.isdigit():
            return Time(int(text), unit)
        # Counts are whole numbers ("1e6tok" is fine, "1.5ep" is not): half a batch does not exist.
        number = float(text)
        if not number.is_integer():
            raise ValueError(
                f"invalid time string {timestring!r}: {unit.name.lower()} counts must be whole numbers, got {text}"
            )
        return Time(int(number), unit)

    @classmethod
    def from_epoch(cls, epoch: int) -> Time[int]:
        return Time(epoch, TimeUnit.EPOCH)

    @classmethod
    def from_batch(cls, batch: int) -> Time[int]:
        return Time(batch, TimeUnit.BATCH)

    @classmethod
    def from_sample(cls, sample: int) -> Time[int]:
        return Time(sample, TimeUnit.SAMPLE)

    @classmethod
    def from_token(cls, token: int) -> Time[int]:
        return Time(token, TimeUnit.TOKEN)

    @classmethod
    def from_duration(cls, duration: float) -> Time[float]:
        return Time(duration, TimeUnit.DURATION)

    def _operand(self, other: object, verb: str) -> Number | None:
        """The plain value to combine with, None when the type is foreign (Python then tries the other side)."""
        if isinstance(other, Time):
            if other.unit is not self.unit:
                raise TypeError(
                    f"cannot {verb} {self} and {other}: the units differ ({self.unit.value} vs "
                    f"{other.unit.value}); convert one of them first"
                )
            value: Number = other.value
            return value
        if isinstance(other, (int, float)) and _is_number(other):
            return other
        return None

    def __add__(self, other: Time[Any] | Number) -> Time[Any]:
        value = self._operand(other, "add")
        return NotImplemented if value is None else Time(self.value + value, self.unit)

    __radd__ = __add__

    def __sub__(self, other: Time[Any] | Number) -> Time[Any]:
        value = self._operand(other, "subtract")
        return NotImplemented if value is None else Time(self.value - value, self.unit)

    def __rsub__(self, other: Number) -> Time[Any]:
        value = self._operand(other, "subtract")
        return NotImplemented if value is None else Time(value - self.value, self.unit)

    def __truediv__(self, other: Time[Any]) -> Time[float]:
        """The fraction of ``other`` that ``self`` covers, e.g. elapsed / max_duration."""
        if not isinstance(other, Time):
            return NotImplemented
        value = self._operand(other, "divide")
        assert value is not None
        return Time(self.value / value, TimeUnit.DURATION)

    def __eq__(self, other: object) -> bool:
        # Different units compare unequal instead of raising, so Times of mixed units can share a set or dict.
        if isinstance(other, Time):
            return self.unit is other.unit and self.value == other.value
        if _is_number(other):
            return self.value == other
        return NotImplemented

    def __hash__(self) -> int:
        # Hash of the value alone keeps `Time(3, "ep") == 3` consistent with hashing.
        return hash(self.value)

    def __lt__(self, other: Time[Any] | Number) -> bool:
        value = self._operand(other, "compare")
        return NotImplemented if value is None else self.value < value

    def __le__(self, other: Time[Any] | Number) -> bool:
        value = self._operand(other, "compare")
        return NotImplemented if value is None else self.value <= value

    def __gt__(self, other: Time[Any] | Number) -> bool:
        value = self._operand(other, "compare")
        return NotImplemented if value is None else self.value > value

    def __ge__(self, other: Time[Any] | Number) -> bool:
        value = self._operand(other, "compare")
        return NotImplemented if value is None else self.value >= value

    def __str__(self) -> str:
        return f"{self.value}{self.unit.value}"

    def __repr__(self) -> str:
        return f"Time({self.value!r}, TimeUnit.{self.unit.name})"


class Timer(Serializable):
    """Counts training progress in every unit at once, so any schedule can ask in the unit it was given in.

    It is the part of a checkpoint that says where to resume; its state_dict holds plain ints only so that it
    loads with ``torch.load(weights_only=True)`` and reads well in a manifest.
    """

    _FIELDS = ("epoch", "batch", "sample", "token", "batch_in_epoch")

    def __init__(self) -> None:
        self._epoch = 0
        self._batch = 0
        self._sample = 0
        self._token = 0
        self._batch_in_epoch = 0

    @property
    def epoch(self) -> Time[int]:
        """Completed epochs."""
        return Time(self._epoch, TimeUnit.EPOCH)

    @property
    def batch(self) -> Time[int]:
        """Completed batches (optimizer steps), over all epochs."""
        return Time(self._batch, TimeUnit.BATCH)

    @property
    def sample(self) -> Time[int]:
        return Time(self._sample, TimeUnit.SAMPLE)

    @property
    def token(self) -> Time[int]:
        return Time(self._token, TimeUnit.TOKEN)

    @property
    def batch_in_epoch(self) -> Time[int]:
        """Completed batches of the current epoch: the sampler's resume point."""
        return Time(self._batch_in_epoch, TimeUnit.BATCH)

    def get(self, unit: TimeUnit | str) -> Time[int]:
        """Progress in ``unit``; DURATION is refused because only State knows the total to divide by."""
        unit = TimeUnit(unit)
        if unit is TimeUnit.EPOCH:
            return self.epoch
        if unit is TimeUnit.BATCH:
            return self.batch
        if unit is TimeUnit.SAMPLE:
            return self.sample
        if unit is TimeUnit.TOKEN:
            return self.token
        raise ValueError("Timer.get cannot answer in 'dur': use State.get_elapsed_duration() instead")

    def on_batch_complete(self, samples: int, tokens: int = 0) -> None:
        """Count one finished batch (of ``samples`` samples and ``tokens`` tokens on this rank's view)."""
        _check_count("samples", samples)
        _check_count("tokens", tokens)
        self._batch += 1
        self._batch_in_epoch += 1
        self._sample += samples
        self._token += tokens

    def on_epoch_complete(self) -> None:
        self._epoch += 1
        self._batch_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "batch": self._batch,
            "sample": self._sample,
            "token": self._token,
            "batch_in_epoch": self._batch_in_epoch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [name for name in self._FIELDS if name not in state]
        if missing:
            raise StateError(f"timer state is missing {', '.join(missing)}; was it written by Timer.state_dict()?")
        for name in self._FIELDS:
            _check_count(f"timer {name}", state[name])
        # Validate everything before assigning anything, so a bad checkpoint leaves the timer untouched.
        for name in self._FIELDS:
            setattr(self, f"_{name}", int(state[name]))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, '_' + name)}" for name in self._FIELDS)
        return f"Timer({fields})"


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
