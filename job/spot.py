"""Spot interruption notices from the cloud's metadata server, polled in a background thread.

AWS warns about two minutes ahead (IMDSv2 ``spot/instance-action``; ``events/recommendations/rebalance``
even earlier, without a deadline); GCP about 30 seconds ahead (``instance/preempted``). A notice makes the
job checkpoint (and upload) at once and keep training until SIGTERM arrives or the deadline is near.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

from job.logs import event
from job.signals import StopRequest
from uploader.config import is_http_url

if TYPE_CHECKING:
    from state import State

logger = logging.getLogger(__name__)

AWS_ENDPOINT = "http://169.254.169.254"
GCP_ENDPOINT = "http://metadata.google.internal"
GCP_NOTICE_SECONDS = 30.0  # GCE sends the ACPI stop about 30 s after setting preempted=TRUE
HTTP_TIMEOUT = 2.0


@dataclass(frozen=True)
class Notice:
    provider: str
    kind: str  # "terminate" / "stop" / "hibernate" (AWS), "rebalance" (AWS), "preempted" (GCP)
    deadline: float | None  # wall-clock seconds since the epoch, None when the cloud gives no time


class Source(Protocol):
    provider: str

    def poll(self) -> Notice | None: ...


def _request(url: str, headers: dict[str, str], method: str = "GET") -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=HTTP_TIMEOUT) as resp:  # noqa: S310 (fixed http endpoints)
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


class AwsImds:
    """IMDSv2: a session token first (PUT), then reads with the token; 404 means no notice yet."""

    provider = "aws"

    def __init__(self, endpoint: str = AWS_ENDPOINT) -> None:
        self.endpoint = endpoint.rstrip("/")
        self._token: str | None = None

    def _token_header(self) -> dict[str, str]:
        if self._token is None:
            status, body = _request(f"{self.endpoint}/latest/api/token",
                                    {"X-aws-ec2-metadata-token-ttl-seconds": "21600"}, method="PUT")
            if status != 200:
                raise OSError(f"IMDSv2 token request answered {status}")
            self._token = body.strip()
        return {"X-aws-ec2-metadata-token": self._token}

    def _get(self, path: str) -> tuple[int, str]:
        status, body = _request(f"{self.endpoint}/latest/meta-data/{path}", self._token_header())
        if status == 401:  # token expired: fetch a new one once
            self._token = None
            status, body = _request(f"{self.endpoint}/latest/meta-data/{path}", self._token_header())
        return status, body

    def poll(self) -> Notice | None:
        status, body = self._get("spot/instance-action")
        if status == 200:
            doc = json.loads(body)
            return Notice("aws", str(doc.get("action", "terminate")), _parse_time(doc.get("time")))
        status, body = self._get("events/recommendations/rebalance")
        if status == 200:
            return Notice("aws", "rebalance", None)
        return None


class GceMetadata:
    provider = "gcp"

    def __init__(self, endpoint: str = GCP_ENDPOINT) -> None:
        self.endpoint = endpoint.rstrip("/")

    def poll(self) -> Notice | None:
        status, body = _request(f"{self.endpoint}/computeMetadata/v1/instance/preempted",
                                {"Metadata-Flavor": "Google"})
        if status == 200 and body.strip().upper() == "TRUE":
            return Notice("gcp", "preempted", time.time() + GCP_NOTICE_SECONDS)
        return None


def _parse_time(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def check_endpoint(url: str | None) -> None:
    """ValueError unless ``url`` is an http(s) base URL: a typo would only turn every poll into a
    warning, and the job would run without the notices it was asked to watch for."""
    if url is None:
        return
    if not is_http_url(url):
        raise ValueError(f"--spot-endpoint {url!r} is not an http(s) URL with a host and a port between 1 and "
                         "65535, e.g. http://169.254.169.254")


def make_source(mode: str, endpoint: str | None) -> Source | None:
    """``auto`` probes AWS, then GCP, each once with a short timeout; None when neither answers."""
    if mode == "off":
        return None
    candidates: list[Source] = []
    if mode in ("aws", "auto"):
        candidates.append(AwsImds(endpoint or AWS_ENDPOINT))
    if mode in ("gcp", "auto"):
        candidates.append(GceMetadata(endpoint or GCP_ENDPOINT))
    if mode != "auto":
        return candidates[0]
    for source in candidates:
        try:
            source.poll()
            return source
        except (OSError, ValueError):
            continue
    logger.warning("--spot-notice auto: no AWS or GCP metadata server answered; spot notices are off")
    return None


class SpotWatcher:
    """Polls a source in a daemon thread; the loop reads :meth:`take` after each step (never blocks)."""

    def __init__(self, source: Source, interval: float = 5.0) -> None:
        self.source, self.interval = source, interval
        self._lock = threading.Lock()
        self._pending: Notice | None = None
        self._seen: set[str] = set()  # one report per kind: GCP's deadline moves with every poll
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spot-notice", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def take(self) -> Notice | None:
        """The newest notice not yet handed out, if any."""
        with self._lock:
            notice, self._pending = self._pending, None
            return notice

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                notice = self.source.poll()
                failures = 0
            except (OSError, ValueError) as e:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning("spot notice poll failed (%s x%d): %s", self.source.provider, failures, e)
                notice = None
            if notice is not None and notice.kind not in self._seen:
                self._seen.add(notice.kind)
                with self._lock:
                    self._pending = notice
            self._stop.wait(self.interval)


@dataclass
class SpotHandler:
    """On a spot notice: checkpoint (and upload) at once, keep training, stop when the deadline nears."""

    watcher: SpotWatcher
    stop: StopRequest
    deadline: float | None = None  # wall clock

    def poll(self, state: State) -> bool:
        """True when a new notice asks for a checkpoint now; requests the stop once the deadline nears."""
        notice = self.watcher.take()
        if notice is not None:
            left = None if notice.deadline is None else round(notice.deadline - time.time(), 1)
            event(logger, "spot_notice", provider=notice.provider, kind=notice.kind, seconds_left=left,
                  deadline=notice.deadline, step=state.timer.batch.value)
            if notice.deadline is not None:
                self.deadline = notice.deadline if self.deadline is None else min(self.deadline, notice.deadline)
        if self.deadline is not None and not self.stop.requested:
            left = self.deadline - time.time()
            if left <= self.stop.grace_period:
                self.stop.request(f"spot notice ({left:.0f}s left)", seconds_left=max(left, 0.0))
        return notice is not None
