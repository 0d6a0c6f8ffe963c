"""SIGTERM / SIGINT turned into a stop request with a deadline.

Kubernetes, Docker and spot reclaimers send SIGTERM and kill the process ``grace`` seconds later. The
first signal asks the loop to stop after the current optimizer step and write a final checkpoint
within the grace period; a second signal means "now": the process exits at once, and the previous
complete checkpoint stays valid because an unfinished save is never visible.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from types import FrameType
from typing import Any

from job.entry import STOP_SIGNALS
from job.exceptions import EXIT_PREEMPTED
from job.logs import event

logger = logging.getLogger(__name__)

HANDLED = STOP_SIGNALS  # job.entry ends the process on them until StopRequest.install


class StopRequest:
    """The one place that knows whether, why and by when the job must stop."""

    def __init__(self, grace_period: float) -> None:
        self.grace_period = grace_period
        self.reason: str | None = None
        self.deadline: float | None = None  # time.monotonic() by which the process must be gone
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request(self, reason: str, seconds_left: float | None = None) -> None:
        """Ask for a stop (first request wins; a later one may only bring the deadline forward)."""
        left = self.grace_period if seconds_left is None else min(seconds_left, self.grace_period)
        deadline = time.monotonic() + left
        if self.reason is None:
            self.reason = reason
        if self.deadline is None or deadline < self.deadline:
            self.deadline = deadline

    def time_left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.monotonic()

    def should_stop(self, state: object = None) -> bool:
        return self.requested

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested:
            event(logger, "killed", level=logging.WARNING, signal=name,
                  message="second signal: exiting at once; the previous complete checkpoint stays valid")
            logging.shutdown()
            os._exit(EXIT_PREEMPTED)
        self.request(name)
        event(logger, "stop_requested", signal=name, grace_seconds=self.grace_period)

    def install(self) -> None:
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
