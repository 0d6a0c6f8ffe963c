"""When to evaluate and checkpoint: every N batches, every N epochs, every N seconds of wall clock, or a
fraction (``dur``) of ``--max-duration``.

Wall-clock saves never change the training result (saving reads the state, it does not touch RNG or
data order), so they are safe for bit-exact resumes while bounding the work a SIGKILL can cost.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from job.exceptions import ConfigError
from state import State, Time, TimeUnit, Timer

_WALL_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")
_WALL_SCALE = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Interval:
    """A training-time interval (``ba``/``ep``), a wall-clock one (``seconds``), or a ``fraction`` of the
    max duration, which :meth:`resolve` turns into ``ba``/``ep`` before training.

    A fraction is resolved from the current run's ``--max-duration`` at every start, never stored in a
    checkpoint: a run resumed with another ``--max-duration`` checkpoints at fractions of the new one.
    """

    every: Time | None = None
    seconds: float | None = None
    fraction: float | None = None

    @classmethod
    def parse(cls, text: str, allow_wall_clock: bool = True) -> Interval:
        m = _WALL_RE.match(text)
        if m and allow_wall_clock:
            seconds = float(m.group(1)) * _WALL_SCALE[m.group(2)]
            if seconds <= 0:
                raise ValueError(f"{text!r}: a wall-clock interval must be positive")
            return cls(seconds=seconds)
        units = "'ba', 'ep', 'dur' (a fraction of --max-duration, e.g. 0.1dur)" + (
            ", or wall clock 's', 'm', 'h' (e.g. 90s, 5m)" if allow_wall_clock else ""
        )
        try:
            every = Time.from_timestring(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an interval; use a number with {units}") from None
        if every.unit == TimeUnit.DURATION:
            if not 0 < every.value <= 1:
                raise ValueError(f"{text!r}: a fraction of --max-duration must be more than 0 and at most 1")
            return cls(fraction=float(every.value))
        if every.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH):
            raise ValueError(f"{text!r}: intervals are in {units}")
        if every.value < 1:
            raise ValueError(f"{text!r}: an interval must be at least 1")
        return cls(every=every)

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g}dur"
        return f"{self.seconds:g}s" if self.seconds is not None else str(self.every)

    def resolve(self, max_duration: Time, steps_per_epoch: int | None = None,
                global_batch: int | None = None) -> Interval:
        """This interval in ``ba``/``ep``: a ``dur`` fraction of ``max_duration``, anything else unchanged.

        A whole number of epochs stays in epochs (evaluation and checkpoints then come at epoch ends, as
        with ``Nep``); anything else becomes the nearest whole number of batches, which needs
        ``steps_per_epoch`` (for a fractional epoch count) or ``global_batch`` (for samples). When the number
        needed is not given yet the interval comes back unresolved, to be resolved again once the data is
        built. Tokens per batch are not known before training, so a token max duration is refused, as is a
        fraction that comes to less than one batch.
        """
        if self.fraction is None:
            return self
        unit, total = max_duration.unit, max_duration.value
        amount = self.fraction * total
        of = f"{self} of --max-duration {max_duration}"
        if unit == TimeUnit.EPOCH and _is_whole(amount) and round(amount) >= 1:
            return Interval(every=Time(round(amount), TimeUnit.EPOCH))
        if unit == TimeUnit.EPOCH:
            if steps_per_epoch is None:
                return self
            batches = amount * steps_per_epoch
        elif unit == TimeUnit.BATCH:
            batches = amount
        elif unit == TimeUnit.SAMPLE:
            if global_batch is None:
                return self
            batches = amount / global_batch
        else:
            raise ValueError(f"{of}: tokens per batch are not known before training; give this interval in ba or ep")
        whole = math.floor(batches + 0.5)
        if whole < 1:
            raise ValueError(f"{of} is {batches:.3g} batches, less than one; use a larger fraction or ba/ep")
        return Interval(every=Time(whole, TimeUnit.BATCH))

    def due(self, timer: Timer, epoch_ended: bool, elapsed_seconds: float) -> bool:
        """Called after every optimizer step; ``elapsed_seconds`` counts since the last event."""
        if self.fraction is not None:
            raise RuntimeError(f"interval {self} was never resolved against --max-duration (Interval.resolve)")
        if self.seconds is not None:
            return elapsed_seconds >= self.seconds
        assert self.every is not None
        if self.every.unit == TimeUnit.BATCH:
            return timer.batch.value % int(self.every.value) == 0
        return epoch_ended and timer.epoch.value % int(self.every.value) == 0


def _is_whole(value: float) -> bool:
    """Whole up to float noise: 0.1 * 30 is 3.0000000000000004 and means 3 epochs."""
    return math.isclose(value, round(value), rel_tol=1e-9, abs_tol=1e-9)


def resolve_at_start(flag: str, interval: Interval, state: State, global_batch: int) -> Interval:
    """``interval`` in ba/ep for this start, once the data says how long an epoch is; the CLI resolved
    what ``--max-duration`` alone decides. ConfigError (naming ``flag``) when it comes to less than a batch."""
    if interval.fraction is None:
        return interval
    try:
        return interval.resolve(state.max_duration, state.steps_per_epoch, global_batch)
    except ValueError as e:
        raise ConfigError(f"{flag} {e}") from None
