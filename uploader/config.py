"""UploadConfig: every knob of the storage side, validated once, shared by the CLI and the job's API.

The CLI builds one from its options (and their UPLOADER_* environment variables); the job builds one
in code. Nothing below reads the environment, except boto3 for its own credential chain and the
standard AWS_ENDPOINT_URL when ``endpoint_url`` is None.
"""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlparse

from uploader.redact import redact_url

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

ADDRESSING_STYLES = ("auto", "path", "virtual")
# S3's own limits on multipart uploads: every part but the last is at least 5 MiB and at most
# 5 GiB, and one upload has at most 10 000 parts (the uploader grows the part size past that).
MIN_PART_SIZE = 5 * MiB
MAX_PART_SIZE = 5 * GiB
MAX_PARTS = 10_000


@dataclass(frozen=True)
class UploadConfig:
    """How to reach the storage and how hard to try.

    ``part_size`` and ``concurrency`` bound memory: a transfer holds at most about
    ``(concurrency + 1) * part_size`` bytes (144 MiB with the defaults). 16 MiB parts with 8 in
    flight keep a 10 Gbit/s link busy on S3 while keeping a checkpoint's part count low.

    ``max_retry_seconds`` bounds one operation (one request and its response body, e.g. one part
    or one range) on the wall clock, all its attempts together, whatever the server does (see
    uploader.deadline): keep it well above the time one part takes to move on the slowest link
    expected (16 MiB at 1 MiB/s: 16 s). The timeouts bound each connect and each socket read.
    """

    endpoint_url: str | None = None
    region: str | None = None
    addressing: str = "auto"
    max_attempts: int = 8
    max_retry_seconds: float = 120.0
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    multipart_threshold: int = 64 * MiB
    part_size: int = 16 * MiB
    concurrency: int = 8
    keep: int = 3

    def __post_init__(self) -> None:
        if self.endpoint_url is not None and not is_http_url(self.endpoint_url):
            raise ValueError(  # the value may hold a user:password (redacted: the message is printed)
                f"endpoint_url {redact_url(self.endpoint_url)!r} is not an http(s) URL with a host and a port "
                "between 1 and 65535, e.g. http://127.0.0.1:8333"
            )
        if self.addressing not in ADDRESSING_STYLES:
            raise ValueError(f"addressing must be one of {', '.join(ADDRESSING_STYLES)}, not {self.addressing!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 (1 means no retry), not {self.max_attempts}")
        for name in ("max_retry_seconds", "connect_timeout", "read_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, not {getattr(self, name)}")
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise ValueError(
                f"part_size must be between {MIN_PART_SIZE} (5 MiB, the S3 minimum) and {MAX_PART_SIZE} bytes, "
                f"not {self.part_size}"
            )
        if self.multipart_threshold < MIN_PART_SIZE:
            raise ValueError(
                f"multipart_threshold must be >= {MIN_PART_SIZE} bytes (5 MiB), not {self.multipart_threshold}"
            )
        if not 1 <= self.concurrency <= 64:
            raise ValueError(f"concurrency must be between 1 and 64, not {self.concurrency}")
        if self.keep < 1:
            raise ValueError(f"keep must be >= 1 (the newest checkpoint is never deleted), not {self.keep}")


def is_http_url(url: str) -> bool:
    """http(s)://host[:port]: botocore (and urllib, for job.spot's notices) only finds out about a bad port
    (99999, abc) or a broken IPv6 literal at the first request, where it would be reported as a failure
    of the storage or of every poll."""
    try:
        parsed = urlparse(url)
        port = parsed.port  # ValueError when out of range or not a number
    except ValueError:
        return False
    return parsed.scheme in ("http", "https") and bool(parsed.hostname) and port != 0
