"""The Remote interface: the few storage operations the commit protocol needs, and open_remote().

Keys are '/'-separated and relative to the remote's root (``s3://bucket/<prefix>`` or
``file:///<path>``); uploader.layout decides which keys a checkpoint uses. Implementations:
uploader.s3 (S3 and S3-compatible servers) and uploader.filesystem (a shared volume / NFS).

``put_file`` and ``get_file`` are *verified* transfers: both check size and digest against what the
manifest says while the bytes stream (each file is read once) and raise CorruptCheckpoint on a
mismatch, leaving nothing at the destination key that looks complete. ``block_size`` is the
manifest entry's: None for a plain sha256, else the block digest of uploader.hashing.
"""
from __future__ import annotations

import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import urlparse

from uploader.config import UploadConfig
from uploader.redact import redact_url

OnBytes = Callable[[int], None]


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object. ``digest`` is only known from ``head`` (it is object metadata): the digest the
    object was uploaded with, as uploader.hashing.tagged writes it (its algorithm named unless sha256).
    ``etag`` too (S3 only): a download's ranged GETs ask for that version, so that an object replaced
    between them is noticed as a change, not read as a mix of two objects or a short one."""

    key: str
    size: int
    modified: float
    digest: str | None = None
    etag: str | None = None


class Remote(Protocol):
    """What the commit protocol needs from a storage backend; see the module docstring."""

    url: str

    def describe(self) -> str:
        """Where this remote is, for messages: bucket and endpoint, or the folder."""
        ...

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, in key order."""
        ...

    def head(self, key: str) -> ObjectInfo | None:
        """Size and stored digest of one object, None if it does not exist."""
        ...

    def read_bytes(self, key: str, limit: int | None = None) -> bytes | None:
        """A small object's content (manifest, ``latest``), None if it does not exist. With ``limit``
        at most ``limit + 1`` bytes are read, whatever the object's size: a caller that gets more than
        ``limit`` knows the object is too large without having read it."""
        ...

    def write_bytes(self, key: str, data: bytes) -> None:
        """Create or replace a small object atomically (readers see the old or the new content)."""
        ...

    def put_file(
        self,
        key: str,
        path: Path,
        *,
        size: int,
        digest: str,
        algorithm: str,
        block_size: int | None = None,
        on_bytes: OnBytes | None = None,
        abort: threading.Event | None = None,
    ) -> None:
        """Upload a local file whose size and digest (of ``algorithm``, with ``block_size``: a manifest
        entry's) must match; the digest is stored with the object. CorruptCheckpoint only for the local
        file (unreadable, or not what the manifest says): uploader.sync holds the local checkpoint at fault
        for it, so a failure of the remote must be another error (StorageError). A local file this user may
        not read is LocalAccessError (uploader.local.local_read_error), never the checkpoint's fault."""
        ...

    def get_file(
        self,
        key: str,
        path: Path,
        *,
        size: int,
        digest: str,
        algorithm: str,
        block_size: int | None = None,
        on_bytes: OnBytes | None = None,
        abort: threading.Event | None = None,
    ) -> None:
        """Download into ``path``, hashing while writing; CorruptCheckpoint if missing or different,
        LocalWriteError if ``path`` cannot take it (its size is reserved first: uploader.destination).

        Not fsynced: the remote holds the durable copy, and a local checkpoint is verified before any
        use (uploader.sync, "Pull"), so waiting here for the disk would only delay a resume.
        """
        ...

    def copy(self, source: str, dest: str, *, size: int) -> None:
        """Copy one object of ``size`` bytes inside the remote (server-side where the storage can), to set
        a checkpoint aside (uploader.sync); CorruptCheckpoint if the source is missing."""
        ...

    def delete(self, keys: Sequence[str]) -> None:
        """Delete objects, in the order given; missing ones are not an error."""
        ...

    def cancel(self) -> None:
        """Cut the requests in flight and fail every later operation (Aborted), at once: the caller gave up
        waiting (uploader.worker, closed after its timeout), and a request hanging on a silent server would
        otherwise hold it until its retry budget ends. Irreversible; ``close`` still follows."""
        ...

    def close(self) -> None:
        """Release connections and threads."""
        ...


_BUCKET_NAME = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")  # botocore.handlers.VALID_BUCKET (S3 itself is stricter)


def s3_location(url: str) -> tuple[str, str]:
    """(bucket, prefix) of ``s3://bucket/prefix``; ValueError, saying what is expected, otherwise."""
    parsed = urlparse(url)
    # No "@": s3://user:secret@bucket is no bucket name, and would carry the secret into every message.
    if parsed.scheme != "s3" or not parsed.netloc or "@" in parsed.netloc or parsed.query or parsed.fragment:
        raise ValueError(f"not an S3 remote: {redact_url(url)!r}; expected s3://bucket/prefix")
    if not _BUCKET_NAME.fullmatch(parsed.netloc):  # botocore's own check, made at the first request
        raise ValueError(f"{parsed.netloc!r} in {redact_url(url)!r} is not a bucket name: letters, digits, '.', "
                         "'-' and '_' only, at most 255")
    return parsed.netloc, parsed.path


def file_location(url: str) -> Path:
    """The folder of ``file:///absolute/path``; ValueError otherwise (``file://relative`` is a typo
    that would name a host)."""
    parsed = urlparse(url)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
        raise ValueError(f"not a file remote: {redact_url(url)!r}; expected file:///absolute/path (three slashes)")
    return Path(parsed.path)


_UNSUPPORTED = ("unsupported remote {url!r}: use s3://bucket/prefix (S3 or an S3-compatible server) "
                "or file:///absolute/path (a shared volume)")


def check_url(url: str) -> None:
    """Raise ValueError unless open_remote would accept ``url``: a typo fails as bad configuration
    at start-up, before anything is built, and without importing a backend."""
    scheme = urlparse(url).scheme
    if scheme == "s3":
        s3_location(url)
    elif scheme == "file":
        file_location(url)
    else:
        raise ValueError(_UNSUPPORTED.format(url=redact_url(url)))


def open_remote(url: str, config: UploadConfig) -> Remote:
    """A Remote for ``s3://bucket/prefix`` or ``file:///absolute/path``; ValueError for anything else
    (each backend's from_url checks its own URL, with the functions check_url uses).

    No request is made here: a wrong bucket or credentials show up (as BucketNotFound / AuthError)
    on the first operation. The backends are imported here so that file:// never loads boto3.
    """
    scheme = urlparse(url).scheme
    if scheme == "s3":
        from uploader.s3 import S3Remote

        return S3Remote.from_url(url, config)
    if scheme == "file":
        from uploader.filesystem import FileRemote

        return FileRemote.from_url(url)
    raise ValueError(_UNSUPPORTED.format(url=redact_url(url)))
