"""How a checkpoint's bytes are protected on their way to the server, and the proof that they were.

Over HTTPS, TLS protects them: bodies go as UNSIGNED-PAYLOAD (uploader.s3.make_client), nothing added.

Over plain HTTP (a local MinIO or SeaweedFS) something else must, or a byte flipped between this
process and the server's disk is stored, and found only when a resume verifies the checkpoint and
has to fall back to an older one. botocore's answer is to SHA-256-sign every body: about 0.6 CPU-s
per GiB in the client and as much again in the server, which recomputes it. Ours, for the data (the
checkpoint's files): a CRC32C in ``x-amz-checksum-crc32c``, which the server verifies before it stores
the part, answering ``BadDigest`` otherwise (uploader.retry resends it). CRC32C rather than S3's other
CRC, CRC32, because CPUs compute it in hardware (SSE 4.2's ``crc32`` instruction, ARMv8's CRC32C ones)
and PyPI's ``crc32c`` uses them: 0.1 CPU-s per GiB here against 0.5 for ``zlib.crc32``, which was a
third of the sidecar's CPU per uploaded GiB (BENCHMARKS.md, "Nineteenth session"). It catches the same
accidents. It is not a defence against someone on the path, and neither is the signature over plain
HTTP: responses are never signed, so whoever could change an upload could change the download as well;
the manifest's digests catch either at resume, and TLS is the answer to an attacker. Small bodies
(manifests, markers, run logs, the XML of a multipart upload's completion) keep the signature: it costs
nothing there.

A server that does not know the header ignores it, and then does not echo it in its reply (AWS S3,
MinIO, SeaweedFS and Ceph do echo it). Such a reply means the body went unverified: it is sent again,
signed, and so is every later body on this remote; one warning says so. A server that refuses the
header instead (501 NotImplemented, or 400 InvalidArgument / InvalidRequest) is treated the same way:
the request is made again without it, signed; if that fails too, it fails for another reason and that
error is what the caller sees.
"""
from __future__ import annotations

import base64
import logging
import threading
from collections.abc import Callable
from typing import Any

import crc32c
from botocore.exceptions import ClientError

from uploader.retry import error_code

logger = logging.getLogger(__name__)

Body = bytes | bytearray | memoryview
# One request that carries a body: called with the client to send it and the extra parameters
# (the checksum, or nothing); returns botocore's parsed reply.
Request = Callable[[Any, dict[str, str]], dict[str, Any]]

ALGORITHM = "CRC32C"  # botocore's name: the parameters are Checksum{ALGORITHM}, the header is HEADER
HEADER = "x-amz-checksum-crc32c"
# How a server that does not support S3's checksums may refuse one (besides ignoring it).
REFUSALS = frozenset({"NotImplemented", "InvalidArgument", "InvalidRequest"})


def crc32c_base64(body: Body) -> str:
    """S3's encoding of a CRC32C: the big-endian 4 bytes, base64. ``crc32c`` lets go of the GIL for a
    body this size, so the parts in flight are checked on both cores."""
    return base64.b64encode(crc32c.crc32c(body).to_bytes(4, "big")).decode("ascii")


class Transit:
    """Sends the data bodies of one remote: checksummed and unsigned, or signed (see the module docstring).

    ``signed`` is the remote's client; ``make_unsigned`` makes a second one of the same endpoint that
    sends bodies as UNSIGNED-PAYLOAD, at the first body that needs it. None: ``signed`` sends everything
    as it is configured (HTTPS: unsigned already), with no checksum.
    """

    def __init__(self, signed: Any, make_unsigned: Callable[[], Any] | None, where: str) -> None:
        self._signed = signed
        self._make_unsigned = make_unsigned
        self._unsigned: Any = None
        self._where = where
        self._lock = threading.Lock()
        self.checksums = make_unsigned is not None

    def start(self, request: Request) -> dict[str, Any]:
        """CreateMultipartUpload: ``request`` with the parts' checksum announced (S3 wants it), or without."""
        if self.checksums:
            reply = self._unless_refused(request, self._signed, {"ChecksumAlgorithm": ALGORITHM})
            if reply is not None:
                return reply
        return request(self._signed, {})

    def send(self, request: Request, body: Body) -> dict[str, Any]:
        """``request`` once, with the body's CRC32C if checksums are on; again, signed, if the server
        showed it ignored or refused the checksum. Call it inside the retry layer: a BadDigest is retried
        there."""
        if self.checksums:
            sent = crc32c_base64(body)
            reply = self._unless_refused(request, self._unsigned_client(), {f"Checksum{ALGORITHM}": sent})
            if reply is not None and reply.get(f"Checksum{ALGORITHM}") == sent:
                return reply
            if reply is not None:
                self._stop_checksums("ignored it (its reply did not echo it)")
        return request(self._signed, {})

    def part_entry(self, reply: dict[str, Any]) -> dict[str, str]:
        """What CompleteMultipartUpload lists for a part besides its ETag and number."""
        value = reply.get(f"Checksum{ALGORITHM}")
        return {f"Checksum{ALGORITHM}": value} if value else {}

    def close(self) -> None:
        """The second client, if it was made (the caller closes the one it gave for signing)."""
        if self._unsigned is not None:
            self._unsigned.close()

    def _unsigned_client(self) -> Any:
        with self._lock:
            if self._unsigned is None:
                assert self._make_unsigned is not None  # checksums are on only with it
                self._unsigned = self._make_unsigned()
            return self._unsigned

    def _unless_refused(self, request: Request, client: Any, checksum: dict[str, str]) -> dict[str, Any] | None:
        """``request`` with ``checksum``; None, and checksums off from now on, if the server refused it."""
        try:
            return request(client, checksum)
        except ClientError as e:
            if not _refused(e):
                raise
            self._stop_checksums(f"refused it ({error_code(e)[0]})")
            return None

    def _stop_checksums(self, how: str) -> None:
        with self._lock:
            if not self.checksums:
                return
            self.checksums = False
        logger.warning("%s does not verify %s: it %s; checkpoint data is SHA-256-signed from now on, which "
                       "costs more CPU on both sides; use HTTPS, or a server with S3's flexible checksums, to "
                       "avoid that", self._where, HEADER, how)


def _refused(e: ClientError) -> bool:
    code, status = error_code(e)
    return status == 501 or code in REFUSALS
