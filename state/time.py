"""Training progress in explicit units, so a duration like "10ep" can never be mistaken for 10 batches."""

from __future__ import annotations

import logging
import math
import re
from enum import Enum
from typing import Any, Generic, TypeVar

from state.display import brief
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

# A timer's counts must leave room to count on: a checkpoint's manifest keeps them as int64, and a count near
# its end (2**63 - 11 samples) resumed, then wrote checkpoints that every later start refused as damaged.
# Half the range is more samples or tokens than any run will see; a --max-duration past it is refused.
TIMER_LIMIT = 2 ** 62


def _is_number(value: object) -> bool:
    # bool is an int subclass, but `Time(True, "ep")` is always a bug.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class Time(Generic[TValue]):
    """An immutable amount of training time: a value and the unit it is counted in.

    Arithmetic and ordering refuse to mix units, because "5ep + 100ba" has no meaning without knowing the
    dataset size, and guessing it is how schedules silently go wrong.

    Scaling follows Composer v0.6: ``Time(2, "ep") * 0.5``, ``0.5 * Time(2, "ep")`` and
    ``Time(0.5, "dur") * Time(2, "ep")`` are ``1ep``; ``Time(4, "ep") / 2`` is ``2ep``; a count stays an
    int (truncated, as Composer's ``int()`` does) and a ``dur`` stays a float. Deliberate differences, for
    the reasons given at each method: a result within float noise of a whole number is that number
    (``Time(100, "ba") * 0.29`` is 29ba, Composer's is 28ba); mixing units raises TypeError, not
    RuntimeError; different units compare unequal instead of raising; strings are never parsed implicitly.
    """

    __slots__ = ("_value", "_unit")

    def __init__(self, value: TValue, unit: TimeUnit | str) -> None:
        if not _is_number(value):
            raise TypeError(f"Time value must be an int or float, got {type(value).__name__}: {brief(value, 40)}")
        self._unit = TimeUnit(unit)
        # A fraction is a float whatever it was given as (as in Composer), so "1dur" scaled stays a fraction.
        self._value: TValue = float(value) if self._unit is TimeUnit.DURATION else value  # type: ignore[assignment]

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

    def __neg__(self) -> Time[TValue]:
        return Time(-self.value, self.unit)

    def __pos__(self) -> Time[TValue]:
        return Time(self.value, self.unit)

    def __int__(self) -> int:
        return int(self.value)

    def __float__(self) -> float:
        return float(self.value)

    def _scaled(self, factor: Number) -> Time[Any]:
        """``self`` times ``factor`` in its own unit, keeping its value type (Composer's rule)."""
        return Time(_like(self.value, self.value * factor), self.unit)

    def __mul__(self, other: Time[Any] | Number) -> Time[Any]:
        """Scale by a number or by a fraction (``dur``); the other operand's unit is kept.

        Two counts cannot be multiplied: "2ep * 3ba" is no amount of training time.
        """
        if _is_number(other):
            return self._scaled(other)  # type: ignore[arg-type]
        if not isinstance(other, Time):
            return NotImplemented
        if TimeUnit.DURATION not in (self.unit, other.unit):
            raise TypeError(
                f"cannot multiply {self} and {other}: one of them must be a fraction in 'dur' (or a plain number)"
            )
        if self.unit is TimeUnit.DURATION:
            return other._scaled(self.value)
        return self._scaled(other.value)

    __rmul__ = __mul__

    def __truediv__(self, other: Time[Any] | Number) -> Time[Any]:
        """By a Time of the same unit: the fraction of it that ``self`` covers (e.g. elapsed / max_duration).

        By a number: ``self`` scaled down, in its own unit (``Time(4, "ep") / 2`` is ``2ep``).
        """
        if _is_number(other):
            return Time(_like(self.value, self.value / other), self.unit)
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

    def to_timestring(self) -> str:
        """The form ``from_timestring`` parses back, e.g. "5ep" or "0.5dur" (Composer's name for ``str``)."""
        return str(self)

    def __repr__(self) -> str:
        return f"Time({self.value!r}, TimeUnit.{self.unit.name})"


class Timer(Serializable):
    """Counts training progress in every unit at once, so any schedule can ask in the unit it was given in.

    It is the part of a checkpoint that says where to resume; its state_dict holds plain ints only so that it
    loads with ``torch.load(weights_only=True)`` and reads well in a manifest. The keys are Composer v0.6's
    (epoch, batch, sample, token and the three ``*_in_epoch``), so each side's ``Timer.load_state_dict``
    reads the other's timer.

    As in Composer, two timers are equal when all their counters are, a timer compares with a Time by its
    counter in that Time's unit (``Timer() < Time(5, "ep")``), and a timer is unhashable: it is mutable.
    """

    _FIELDS = ("epoch", "batch", "sample", "token", "batch_in_epoch", "sample_in_epoch", "token_in_epoch")
    # Spot-trainer checkpoints written before sample_in_epoch and token_in_epoch existed lack these two.
    _ADDED_FIELDS = ("sample_in_epoch", "token_in_epoch")

    def __init__(self) -> None:
        self._epoch = 0
        self._batch = 0
        self._sample = 0
        self._token = 0
        self._batch_in_epoch = 0
        self._sample_in_epoch = 0
        self._token_in_epoch = 0

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

    @property
    def sample_in_epoch(self) -> Time[int]:
        """Samples of the current epoch; 0 again at each epoch, like ``batch_in_epoch``."""
        return Time(self._sample_in_epoch, TimeUnit.SAMPLE)

    @property
    def token_in_epoch(self) -> Time[int]:
        """Tokens of the current epoch; 0 again at each epoch, like ``batch_in_epoch``."""
        return Time(self._token_in_epoch, TimeUnit.TOKEN)

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
        self._sample_in_epoch += samples
        self._token += tokens
        self._token_in_epoch += tokens

    def on_epoch_complete(self) -> None:
        self._epoch += 1
        self._batch_in_epoch = 0
        self._sample_in_epoch = 0
        self._token_in_epoch = 0

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, f"_{name}") for name in self._FIELDS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from Composer's or this project's timer state, including those written before the
        ``sample_in_epoch``/``token_in_epoch`` counters (see :func:`_derive_in_epoch` for their values)."""
        required = [name for name in self._FIELDS if name not in self._ADDED_FIELDS]
        missing = [name for name in required if name not in state]
        if missing:
            raise StateError(f"timer state is missing {', '.join(missing)}; was it written by Timer.state_dict()?")
        for name in self._FIELDS:
            if name in state:
                _check_count(f"timer {name}", state[name])
        values = {name: int(state[name]) for name in required}
        for name, total in (("sample_in_epoch", "sample"), ("token_in_epoch", "token")):
            values[name] = (
                int(state[name])
                if name in state
                else _derive_in_epoch(
                    values[total], values["epoch"], values["batch"], values["batch_in_epoch"], name
                )
            )
        # Validate everything before assigning anything, so a bad checkpoint leaves the timer untouched.
        for name, value in values.items():
            setattr(self, f"_{name}", value)

    def _compared(self, other: object) -> Time[int] | None:
        """This timer's counter in ``other``'s unit, None when ``other`` is not a Time."""
        return self.get(other.unit) if isinstance(other, Time) else None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Timer):
            return self.state_dict() == other.state_dict()
        counter = self._compared(other)
        return NotImplemented if counter is None else counter == other

    # Equal timers stop being equal as soon as one of them counts a batch: a hash would change under a dict.
    __hash__ = None  # type: ignore[assignment]

    def __lt__(self, other: object) -> bool:
        counter = self._compared(other)
        return NotImplemented if counter is None else counter < other  # type: ignore[operator]

    def __le__(self, other: object) -> bool:
        counter = self._compared(other)
        return NotImplemented if counter is None else counter <= other  # type: ignore[operator]

    def __gt__(self, other: object) -> bool:
        counter = self._compared(other)
        return NotImplemented if counter is None else counter > other  # type: ignore[operator]

    def __ge__(self, other: object) -> bool:
        counter = self._compared(other)
        return NotImplemented if counter is None else counter >= other  # type: ignore[operator]

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, '_' + name)}" for name in self._FIELDS)
        return f"Timer({fields})"


def _derive_in_epoch(total: int, epoch: int, batch: int, batch_in_epoch: int, name: str) -> int:
    """An ``*_in_epoch`` counter that an older spot-trainer checkpoint did not save.

    Exact at an epoch boundary (0) and during the first epoch (the total). Elsewhere it assumes the batches
    so far were all the same size, which the job's global batches (drop_last) make true for samples; for
    tokens it is an estimate. Nothing in spot-trainer reads these counters to resume (the data position is
    epoch and batch_in_epoch), so an estimate can only skew what a callback reports until the epoch ends.
    """
    if batch_in_epoch == 0:
        return 0
    if epoch == 0 or batch <= batch_in_epoch:
        return total
    derived = total * batch_in_epoch // batch
    logger.info(
        "the checkpoint's timer has no %s (written before it existed); assuming equal batches: %d", name, derived
    )
    return derived


def _like(original: Number, value: float) -> Any:
    """``value`` as the type of ``original``: counts stay ints, fractions stay floats.

    Composer truncates with ``int()``; so does this, except that a result within float noise of a whole
    number is that number, so that ``100ba * 0.29`` is 29ba and not 28ba (0.29 * 100 is 28.999999999999996).
    """
    if isinstance(original, float):
        return float(value)
    nearest = round(value)
    if math.isclose(value, nearest, rel_tol=1e-9, abs_tol=1e-9):
        return int(nearest)
    return int(value)


def _check_count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {brief(value, 40)}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
