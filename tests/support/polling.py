"""Waiting for something another thread or process does, with a generous deadline."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, interval: float = 0.05, what: str = "") -> None:
    """Poll ``predicate`` until it is truthy; fail the test (AssertionError) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or predicate}")
        time.sleep(interval)


def outcome_within(seconds: float, fn: Callable[[], Any]) -> BaseException | None:
    """Run ``fn`` in a thread; fail unless it ends within ``seconds``; its exception (None if none).

    A thread, so that a regression fails the test after ``seconds`` instead of hanging it (a fixture's
    proxy.close() then ends the stuck request)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            outcome.append(e)

    worker = threading.Thread(target=run, name="test-operation", daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s"
    return outcome[0]
