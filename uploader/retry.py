"""The ONE retry layer of every storage request, and what counts as worth retrying.

Decision: tenacity owns retries; botocore makes exactly one attempt per call
(``retries={"total_max_attempts": 1}`` in uploader.s3). Careful: botocore's ``max_attempts`` key
counts *retries* (``{"max_attempts": 1}`` means two attempts), ``total_max_attempts`` counts attempts.

Why tenacity and not botocore:

* the unit we retry is an *operation* as we define it: one request plus reading its response body
  (a GET whose body stream breaks half-way is retried here; botocore's retries end at the headers),
  one part of a multipart upload (a reset re-sends 16 MiB, not the whole file);
* one place sets the limits (attempts AND total seconds, both from UploadConfig), logs one line per
  retry and can be interrupted (a watch whose grace period is over stops retrying at once);
* ``max_retry_seconds`` is a wall-clock bound on the whole operation, all attempts together: no
  attempt starts, and no pause between attempts ends, after the operation's deadline, and the S3
  Remote runs each attempt under that same deadline (uploader.deadline cuts its connection), since a
  server that trickles bytes never trips a socket timeout (issue 16);
* s3transfer is not used for the same reason: its downloads retry streaming errors themselves
  (a second layer) and a failed upload restarts the whole file.

Above this layer there is one deliberate loop, at the level of a whole checkpoint, not of a request: the
job's background uploader (uploader.worker) and the sidecar (uploader.watch) try a checkpoint whose
upload ran out of this budget again later (a retry interval, or the next poll), each time with one log
line. An outage may outlast any budget, and giving up would leave the remote behind for the rest of the
run; a newer checkpoint replaces the one waiting. The job's loop ends with the job: its final upload waits
at most --final-upload-timeout, then exit 5; the sidecar's once it is told to stop (SIGTERM, as Kubernetes
sends a native sidecar when the job's container exits): --grace more, then exit 5. ``uploader sync`` has no such loop:
it exits 5 at once.

file:// remotes are not retried at all: a local disk has no transient failures worth a retry, and an
NFS hard mount already retries inside the kernel (that is its one layer).

Transient: connection refused/reset/closed, timeouts, broken or short response bodies, HTTP 5xx
(except 501), 429, throttling/timeout codes (SlowDown, RequestTimeout...) and a body the server
received damaged (BadDigest, XAmzContentSHA256Mismatch: uploader.transit). Everything else, in
particular 403 (wrong or missing credentials, access denied) and 404 (no such bucket), fails at once.
"""
from __future__ import annotations

import http.client
import logging
import time
from collections.abc import Callable
from typing import TypeVar

import urllib3.exceptions
from botocore import exceptions as boto_errors
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from uploader.config import UploadConfig
from uploader.redact import redact_text

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Backoff: 0.25 s, 0.5 s, 1 s, ... capped at 20 s, plus up to 0.25 s of jitter so that the parts of
# one upload (and several pods) do not retry in lockstep against a throttling server.
INITIAL_WAIT = 0.25
MAX_WAIT = 20.0
JITTER = 0.25

TRANSIENT_ERROR_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "InternalError",
        "ServiceUnavailable",
        # A body that reached the server damaged (its CRC32C or SHA-256 does not match, uploader.transit):
        # sent again, it arrives whole.
        "BadDigest",
        "XAmzContentSHA256Mismatch",
    }
)

_TRANSIENT_EXCEPTIONS: tuple[type[BaseException], ...] = (
    boto_errors.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError (SSLError excluded below)
    boto_errors.HTTPClientError,  # ConnectionClosedError, ReadTimeoutError, ResponseStreamingError
    boto_errors.IncompleteReadError,
    urllib3.exceptions.ProtocolError,
    urllib3.exceptions.ReadTimeoutError,
    http.client.IncompleteRead,
    ConnectionError,  # the builtin one: resets seen while we read a body ourselves
    TimeoutError,
)


def error_code(exc: BaseException) -> tuple[str, int]:
    """The S3 error code and HTTP status of a botocore ClientError, ("", 0) for anything else."""
    if isinstance(exc, boto_errors.ClientError):
        return str(exc.response.get("Error", {}).get("Code", "")), int(
            exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        )
    return "", 0


def is_transient(exc: BaseException) -> bool:
    """True for failures that a later attempt can fix (see the module docstring for the list)."""
    if isinstance(exc, boto_errors.ClientError):
        code, status = error_code(exc)
        return (status >= 500 and status != 501) or status == 429 or code in TRANSIENT_ERROR_CODES
    if isinstance(exc, boto_errors.SSLError):
        return False  # a certificate problem does not go away by itself
    return isinstance(exc, _TRANSIENT_EXCEPTIONS)


def describe(exc: BaseException) -> str:
    """A short, secret-free description of a failure for log lines and error messages."""
    code, status = error_code(exc)
    if code:
        return f"{code} (HTTP {status})"
    # botocore's texts hold the request URL (EndpointConnectionError: 'Could not connect to the
    # endpoint URL: "http://user:pass@host/bucket?..."'): userinfo and query strings are cut out.
    text = redact_text(str(exc).splitlines()[0]) if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _stop_when(stop_base):
    """Stop retrying as soon as ``predicate()`` is true (an abort requested from outside)."""

    def __init__(self, predicate: Callable[[], bool]) -> None:
        self._predicate = predicate

    def __call__(self, retry_state: RetryCallState) -> bool:
        return self._predicate()


class _stop_at(stop_base):
    """Stop once the next attempt could not start before ``deadline`` (time.monotonic()): the
    operation's budget is spent. tenacity 9 computes the pause (``upcoming_sleep``) before asking;
    where a version does not, this is a plain time limit, and _wait_until keeps pauses short of it."""

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> bool:
        return time.monotonic() + float(getattr(retry_state, "upcoming_sleep", 0.0) or 0.0) >= self._deadline


class _wait_until(wait_base):
    """``wait``, but never past ``deadline``: the pause before a retry does not overrun the budget."""

    def __init__(self, wait: wait_base, deadline: float) -> None:
        self._wait = wait
        self._deadline = deadline

    def __call__(self, retry_state: RetryCallState) -> float:
        return max(0.0, min(self._wait(retry_state), self._deadline - time.monotonic()))


def _sleeper(abort: Callable[[], bool] | None) -> Callable[[float], None]:
    """Sleep between attempts, but wake up within 0.1 s when an abort is requested."""

    def sleep(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if abort is not None and abort():
                return
            time.sleep(min(left, 0.1))

    return sleep


def retrying(config: UploadConfig, what: str, abort: Callable[[], bool] | None = None,
             deadline: float | None = None) -> Retrying:
    """The retry policy for one operation; ``what`` names it in the per-retry log line.

    ``deadline`` (time.monotonic()) is when the operation's budget ends, by default
    ``config.max_retry_seconds`` from now; a caller that also bounds each attempt (uploader.s3)
    passes the same value to both."""
    if deadline is None:
        deadline = time.monotonic() + config.max_retry_seconds
    stop = stop_after_attempt(config.max_attempts) | _stop_at(deadline)
    if abort is not None:
        stop = stop | _stop_when(abort)

    def log_retry(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        pause = state.next_action.sleep if state.next_action else 0.0
        logger.warning(
            "%s failed (%s); retry %d of at most %d in %.1f s",
            what,
            describe(exc) if exc else "?",
            state.attempt_number,
            config.max_attempts - 1,
            pause,
        )

    return Retrying(
        stop=stop,
        # = wait_exponential_jitter, spelled so that it works (without deprecation warnings) from
        # tenacity 8.2, whose wait_exponential_jitter takes `initial`, to 9.x, which deprecates it.
        wait=_wait_until(wait_exponential(multiplier=INITIAL_WAIT, max=MAX_WAIT) + wait_random(0, JITTER), deadline),
        retry=retry_if_exception(is_transient),
        before_sleep=log_retry,
        sleep=_sleeper(abort),
        reraise=False,
    )
