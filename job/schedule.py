"""When to evaluate and checkpoint: every N batches, every N epochs, or every N seconds of wall clock.

Wall-clock saves never change the training result (saving reads the state, it does not touch RNG or
data order), so they are safe for bit-exact resumes while bounding the work a SIGKILL can cost.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from state import Time, TimeUnit, Timer

_WALL_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")
_WALL_SCALE = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Interval:
    """Either a training-time interval (``ba``/``ep``) or a wall-clock one (``seconds``)."""

    every: Time | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str, allow_wall_clock: bool = True) -> Interval:
        m = _WALL_RE.match(text)
        if m and allow_wall_clock:
            seconds = float(m.group(1)) * _WALL_SCALE[m.group(2)]
            if seconds <= 0:
                raise ValueError(f"{text!r}: a wall-clock interval must be positive")
            return cls(seconds=seconds)
        units = "'ba', 'ep'" + (", or wall clock 's', 'm', 'h' (e.g. 90s, 5m)" if allow_wall_clock else "")
        try:
            every = Time.from_timestring(text)
        except ValueError:
            raise ValueError(f"{text!r} is not an interval; use a number with {units}") from None
        if every.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH):
            raise ValueError(f"{text!r}: intervals are in {units}")
        if every.value < 1:
            raise ValueError(f"{text!r}: an interval must be at least 1")
        return cls(every=every)

    def __str__(self) -> str:
        return f"{self.seconds:g}s" if self.seconds is not None else str(self.every)

    def due(self, timer: Timer, epoch_ended: bool, elapsed_seconds: float) -> bool:
        """Called after every optimizer step; ``elapsed_seconds`` counts since the last event."""
        if self.seconds is not None:
            return elapsed_seconds >= self.seconds
        assert self.every is not None
        if self.every.unit == TimeUnit.BATCH:
            return timer.batch.value % int(self.every.value) == 0
        return epoch_ended and timer.epoch.value % int(self.every.value) == 0
