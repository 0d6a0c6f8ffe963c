"""Which failures are retried, and how the one retry layer stops."""
from __future__ import annotations

import http.client
import logging

import pytest
import urllib3.exceptions
from botocore import exceptions as boto_errors
from tenacity import RetryError

from uploader.config import UploadConfig
from uploader.retry import is_transient, retrying


def client_error(code: str, status: int) -> boto_errors.ClientError:
    reply = {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}
    return boto_errors.ClientError(reply, "PutObject")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (client_error("SlowDown", 503), True),
        (client_error("InternalError", 500), True),
        (client_error("TooManyRequests", 429), True),
        (client_error("RequestTimeout", 400), True),
        (client_error("NotImplemented", 501), False),
        (client_error("AccessDenied", 403), False),
        (client_error("InvalidAccessKeyId", 403), False),
        (client_error("SignatureDoesNotMatch", 403), False),
        (client_error("NoSuchBucket", 404), False),
        (client_error("404", 404), False),
        (boto_errors.EndpointConnectionError(endpoint_url="http://x"), True),
        (boto_errors.ConnectionClosedError(endpoint_url="http://x"), True),
        (boto_errors.ReadTimeoutError(endpoint_url="http://x"), True),
        (boto_errors.ConnectTimeoutError(endpoint_url="http://x"), True),
        (boto_errors.ResponseStreamingError(error="reset"), True),
        (boto_errors.IncompleteReadError(actual_bytes=1, expected_bytes=2), True),
        (urllib3.exceptions.ProtocolError("broken"), True),
        (http.client.IncompleteRead(b""), True),
        (ConnectionResetError(), True),
        (boto_errors.SSLError(endpoint_url="https://x", error="bad certificate"), False),
        (boto_errors.NoCredentialsError(), False),
        (ValueError("bug"), False),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_transient_classification(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


class Flaky:
    """Raises ``exc`` on every call and counts the calls."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        raise self.exc


def test_transient_errors_are_retried_up_to_max_attempts_with_a_log_line_each(caplog: pytest.LogCaptureFixture) -> None:
    flaky = Flaky(client_error("SlowDown", 503))
    with caplog.at_level(logging.WARNING, logger="uploader.retry"), pytest.raises(RetryError):
        retrying(UploadConfig(max_attempts=3), "PUT k")(flaky)
    assert flaky.calls == 3
    assert [r.getMessage().split(";")[1].strip().split(" in ")[0] for r in caplog.records] == [
        "retry 1 of at most 2", "retry 2 of at most 2"]


def test_permanent_errors_are_not_retried() -> None:
    flaky = Flaky(client_error("AccessDenied", 403))
    with pytest.raises(boto_errors.ClientError):
        retrying(UploadConfig(max_attempts=8), "PUT k")(flaky)
    assert flaky.calls == 1


def test_an_abort_stops_retrying_at_once() -> None:
    flaky = Flaky(boto_errors.EndpointConnectionError(endpoint_url="http://x"))
    with pytest.raises(RetryError):
        retrying(UploadConfig(max_attempts=8), "GET k", abort=lambda: flaky.calls >= 2)(flaky)
    assert flaky.calls == 2


class FakeClock:
    """uploader.retry's ``time``: a clock that moves only when the retry layer sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_the_time_limit_stops_retrying_before_the_attempts_run_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("uploader.retry.time", FakeClock())
    flaky = Flaky(boto_errors.EndpointConnectionError(endpoint_url="http://x"))
    with pytest.raises(RetryError):
        retrying(UploadConfig(max_attempts=50, max_retry_seconds=0.5), "GET k")(flaky)
    assert 1 < flaky.calls < 50


@pytest.mark.parametrize("jitter", ["least", "most"])
def test_no_attempt_starts_once_the_budget_is_spent(monkeypatch: pytest.MonkeyPatch, jitter: str) -> None:
    """max_retry_seconds bounds the whole operation: a pause that would end past it is not taken, whatever
    the jitter (the pauses are 0.25-0.5 s, then 0.5-0.75 s, ...)."""
    clock = FakeClock()
    monkeypatch.setattr("uploader.retry.time", clock)
    monkeypatch.setattr("tenacity.wait.random.uniform", lambda a, b: a if jitter == "least" else b)
    starts: list[float] = []
    flaky = Flaky(boto_errors.EndpointConnectionError(endpoint_url="http://x"))

    def attempt() -> None:
        starts.append(clock.now)
        flaky()

    began = clock.now
    with pytest.raises(RetryError):
        retrying(UploadConfig(max_attempts=50, max_retry_seconds=0.6), "GET k")(attempt)
    offsets = [t - began for t in starts]
    assert len(offsets) == 2 and 0.25 <= offsets[1] <= 0.5, offsets  # a third could start 0.75 s in at best
