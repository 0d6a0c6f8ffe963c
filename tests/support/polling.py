"""Waiting for something another thread or process does, with a generous deadline."""
from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> None:
    """Poll ``predicate`` until it is truthy; fail the test (AssertionError) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)
