"""A bounded, ordered parallel map: the engine of multipart uploads and ranged downloads.

Both directions need the same shape: parts travel concurrently, but the bytes must be hashed in file
order (sha256 is sequential), and memory must stay bounded. ``ordered_map`` draws a new item only
when a slot frees up, so a file is read no faster than it is sent, and yields results in input
order, so a download is written and hashed sequentially while later parts are still in flight.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

A = TypeVar("A")
R = TypeVar("R")


def ordered_map(
    fn: Callable[[A], R], items: Iterable[A], *, window: int, failed: threading.Event, name: str = "uploader"
) -> Generator[R, None, None]:
    """``map(fn, items)`` with at most ``window`` calls in flight, results in input order.

    On the first failure (in ``fn``, in ``items`` or in the consumer) ``failed`` is set so that calls
    still running stop retrying, calls not started are cancelled, and the error is re-raised once the
    running ones have returned: no thread outlives the transfer.
    """
    if window < 1:
        raise ValueError("window must be >= 1")
    with ThreadPoolExecutor(max_workers=window, thread_name_prefix=name) as pool:
        inflight: deque[Future[R]] = deque()
        try:
            for item in items:
                inflight.append(pool.submit(fn, item))
                if len(inflight) >= window:
                    yield inflight.popleft().result()
            while inflight:
                yield inflight.popleft().result()
        except BaseException:
            failed.set()
            for future in inflight:
                future.cancel()
            raise
