"""Wall-clock deadlines for storage requests: a watchdog that cuts the connection of an attempt whose
time is up, so that every operation ends, whatever the server does.

Why: socket timeouts (botocore's ``read_timeout``) bound each ``recv``, not a response. A server that
trickles one byte every half second never trips them, and tenacity's time limit is only checked
between attempts, so one attempt could run for hours (issue 16: ``uploader ls --max-retry-seconds 2``
ran for 30 s, the job's start-up for 4 minutes). A blocked ``recv`` cannot be interrupted from its
own thread; it can from another one: ``shutdown(SHUT_RDWR)`` on the socket makes the read return
(end of file) and the write fail, the request fails as a broken connection would, and the retry
layer (uploader.retry) sees a transient error with its time budget spent, and stops.

How: a thread runs each attempt inside ``bounded(deadline, fn)``; the connections it uses register
themselves with ``track(connection)`` (uploader.s3 installs connection classes that do so when a
request starts on them). One watchdog thread sleeps until the earliest deadline of the attempts in
progress, then shuts down the sockets of every attempt past its deadline, and keeps doing so every
RESWEEP seconds until that attempt ends (a connection still connecting had no socket yet). It runs
only while attempts are in progress: it exits when the last one ends, so nothing is left behind.

An attempt whose connection was cut does not return what it got: a response cut in its headers or
body can look complete (a 200 with an empty listing), so such an attempt always raises
DeadlineExceeded, a TimeoutError (transient, see uploader.retry), even if ``fn`` returned.

Residual limits: name resolution (getaddrinfo) cannot be interrupted; a connection being
established (TCP connect, TLS handshake) has no socket to shut yet, each of its reads is bounded by
``connect_timeout`` only; requests that are not the attempt's own (credential providers' HTTP
calls, made by botocore inside it) are not tracked. Shutting a socket down races with its owner closing it only in the nanoseconds between
CPython reading its file descriptor and the system call; the worst outcome is one spurious,
retried, connection error on whatever reused that descriptor number.
"""
from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from uploader.exceptions import Aborted, DeadlineExceeded, LocalWriteError

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How often sockets of an attempt past its deadline are shut again, until the attempt ends: a
# connection that was still connecting at the deadline gets its socket afterwards.
RESWEEP = 0.1


class _Attempt:
    """One attempt in progress: its deadline, the connections it has used, whether it was cut."""

    __slots__ = ("deadline", "abort", "aborted", "connections", "fired", "shut")

    def __init__(self, deadline: float, abort: Callable[[], bool] | None = None) -> None:
        self.deadline = deadline
        self.abort = abort  # true once the caller gives the operation up: cut then, not at the deadline
        self.aborted = False
        # connection -> the sockets seen on it during this attempt. Kept, not only read from the
        # connection at the deadline: http.client drops a connection's socket (sock = None) once a
        # response says "Connection: close" (an nginx in front of S3 does, every N requests), and
        # the response body then still streams from that socket.
        self.connections: dict[Any, list[socket.socket]] = {}
        self.fired = False  # at least one of its sockets was shut down
        self.shut: set[socket.socket] = set()  # those, not to shut them again every RESWEEP


def _socket_of(connection: Any) -> socket.socket | None:
    sock = getattr(connection, "sock", None)
    if sock is not None and not isinstance(sock, socket.socket):
        sock = getattr(sock, "socket", None)  # urllib3's SSLTransport (TLS in TLS, via an HTTPS proxy)
    return sock if isinstance(sock, socket.socket) else None


class Watchdog:
    """Knows, per thread, the attempt in progress and its connections; cuts them at the deadline.

    Thread-safe: any number of threads run attempts at once (S3Remote.get_file runs its ranges in
    parallel), each its own.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._attempts: set[_Attempt] = set()
        self._owner: dict[Any, _Attempt] = {}  # connection -> the attempt that last used it
        self._local = threading.local()  # .stack: this thread's attempts, innermost last
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def attempt(self, deadline: float, abort: Callable[[], bool] | None = None) -> Iterator[_Attempt]:
        """Run the body as one attempt that must end by ``deadline`` (time.monotonic()), or as soon as
        ``abort()`` is true (checked every RESWEEP seconds); read ``fired`` on the yielded attempt after
        the block to know whether it was cut, ``aborted`` whether for ``abort``."""
        attempt = _Attempt(deadline, abort)
        stack: list[_Attempt] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(attempt)
        with self._cond:
            self._attempts.add(attempt)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="uploader-deadline", daemon=True)
                self._thread.start()
            self._cond.notify()
        try:
            yield attempt
        finally:
            stack.pop()
            with self._cond:
                self._attempts.discard(attempt)
                for conn in attempt.connections:
                    if self._owner.get(conn) is attempt:
                        del self._owner[conn]
                attempt.connections.clear()
                attempt.shut.clear()
                self._cond.notify()  # the watchdog may have nothing left to watch: let it exit

    def track(self, connection: Any) -> None:
        """``connection`` (anything with a ``sock`` attribute, e.g. an http.client connection) is
        being used by this thread: it belongs to this thread's current attempt from now on, with the
        socket it has now (call again once it has connected), and no longer to the attempt that used
        it before (connections are pooled and reused). Outside any attempt this only forgets the
        previous owner."""
        stack = getattr(self._local, "stack", None)
        current = stack[-1] if stack else None
        sock = _socket_of(connection)
        with self._cond:
            previous = self._owner.get(connection)
            if previous is not None and previous is not current:
                previous.connections.pop(connection, None)
                del self._owner[connection]
            if current is None:
                return
            sockets = current.connections.setdefault(connection, [])
            if sock is not None and sock not in sockets:
                sockets.append(sock)
            self._owner[connection] = current
            if current.deadline <= time.monotonic():
                self._cond.notify()  # already late: cut it now, not at the next sweep

    def _run(self) -> None:
        with self._cond:
            while self._attempts:
                now = time.monotonic()
                for attempt in self._attempts:
                    if attempt.abort is not None and not attempt.aborted:
                        try:
                            attempt.aborted = bool(attempt.abort())
                        except Exception:  # noqa: BLE001 - a bug in a caller's predicate must not end the watchdog
                            logger.exception("an abort predicate failed; its attempt keeps its deadline only")
                            attempt.abort = None
                late = [a for a in self._attempts if a.deadline <= now or a.aborted]
                for attempt in late:
                    self._cut(attempt)
                pending = [a.deadline - now for a in self._attempts if a not in late]
                polled = late or any(a.abort is not None for a in self._attempts)
                self._cond.wait(min(pending + ([RESWEEP] if polled else [])))
            self._thread = None

    @staticmethod
    def _cut(attempt: _Attempt) -> None:
        """Shut down every socket of a late attempt (called with the lock held)."""
        for conn, sockets in attempt.connections.items():
            current = _socket_of(conn)
            if current is not None and current not in sockets:
                sockets.append(current)  # connected since it was tracked
            for sock in sockets:
                if sock in attempt.shut:
                    continue
                try:
                    # socket.socket's shutdown, not SSLSocket's: that one also drops the TLS object,
                    # which the attempt's own thread is using; the system call alone wakes its read.
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    continue  # closed (nothing waits on it) or still connecting (tried again next sweep)
                attempt.shut.add(sock)
                attempt.fired = True
                logger.debug("cut a connection %.1f s past its deadline", time.monotonic() - attempt.deadline)


_WATCHDOG = Watchdog()


def track(connection: Any) -> None:
    """See Watchdog.track (the process-wide watchdog)."""
    _WATCHDOG.track(connection)


def bounded(deadline: float, fn: Callable[[], T], budget: float | None = None,
            abort: Callable[[], bool] | None = None) -> T:
    """Run ``fn`` as one attempt that ends by ``deadline`` (time.monotonic()): its tracked
    connections are cut when it is reached, and then DeadlineExceeded is raised whatever ``fn`` did
    (chained to its exception, if any: a cut response fails in many ways, some of which look
    permanent, such as an XML parse error), except a LocalWriteError, which no cut connection causes.
    ``budget`` (seconds) only words the message. Once ``abort()`` is true they are cut too, and Aborted
    is raised: a job that gave up waiting for an upload (--final-upload-timeout) leaves now, not when a
    request that hangs reaches its deadline.
    KeyboardInterrupt and other BaseExceptions pass unchanged."""
    with _WATCHDOG.attempt(deadline, abort) as attempt:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, as it is or as DeadlineExceeded
            failure: Exception | None = e
        else:
            failure = None
    if attempt.fired and attempt.aborted and not isinstance(failure, LocalWriteError):
        raise Aborted("stopped on request; the request in flight was cut") from failure
    if attempt.fired and not isinstance(failure, LocalWriteError):  # the local disk failed, whatever the clock
        limit = f"the {budget:g} s retry budget (max_retry_seconds)" if budget is not None else "its deadline"
        raise DeadlineExceeded(f"no complete response within {limit}; the connection was cut") from failure
    if failure is not None:
        raise failure
    return result
