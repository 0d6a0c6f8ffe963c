"""Progress of long transfers: bytes, rate and ETA, at most one log record per second.

The library only emits log records (logger ``uploader.progress``, each with a ``progress`` dict
attached); how they look is the CLI's business (uploader.console): a line rewritten in place on a
terminal, JSON lines otherwise. The job, which configures its own logging, gets plain log lines.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """Counts the bytes of one transfer (thread-safe: parts report from worker threads)."""

    def __init__(
        self, what: str, total: int, *, interval: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self._interval = interval
        self._clock = clock
        self._start = clock()
        self._last_emit = self._start
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = self._clock()
            if now - self._last_emit < self._interval:
                return
            self._last_emit = now
            record = self._snapshot(now, final=False)
        self._emit(record)

    def close(self) -> None:
        """Log the final line (only if the transfer took long enough to have shown progress)."""
        with self._lock:
            now = self._clock()
            if now - self._start < self._interval:
                return
            record = self._snapshot(now, final=True)
        self._emit(record)

    def _snapshot(self, now: float, *, final: bool) -> dict[str, Any]:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done / elapsed
        left = max(self.total - self.done, 0)
        return {
            "event": "progress",
            "what": self.what,
            "bytes": self.done,
            "total": self.total,
            "rate": round(rate),
            "eta": round(left / rate, 1) if rate > 0 else None,
            "final": final,
        }

    @staticmethod
    def _emit(p: dict[str, Any]) -> None:
        percent = 100 * p["bytes"] / p["total"] if p["total"] else 100.0
        eta = "done" if p["final"] else (f"ETA {human_seconds(p['eta'])}" if p["eta"] is not None else "ETA ?")
        logger.info(
            "%s: %s / %s (%.0f%%), %s/s, %s",
            p["what"],
            human_bytes(p["bytes"]),
            human_bytes(p["total"]),
            percent,
            human_bytes(p["rate"]),
            eta,
            extra={"progress": p},
        )
