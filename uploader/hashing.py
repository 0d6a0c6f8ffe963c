"""File digests, computed while files are written, sent or received, or in one read; writeback hints.

Three digests exist; a manifest entry says which one it holds by its ``block_size`` and algorithm:

* ``block_size`` None (format 1): the sha256 of the file's bytes. One stream, in order: a transfer
  must hash its parts one after the other, on one core.
* ``block_size`` B, sha256 (format 2): the sha256 of the concatenated sha256 digests of the file's
  B-byte blocks (the last one may be shorter; an empty file has no blocks). Every block can be hashed
  by whichever thread holds its bytes, so a transfer of eight ranges hashes on eight threads, while
  the bytes are still in that thread's cache. (The idea of S3's composite checksums.)
* ``block_size`` B, BLAKE3 (format 3, written by default): the same construction with BLAKE3 (PyPI
  ``blake3``) in place of sha256, for blocks and for their combination. BLAKE3 is a cryptographic
  hash too (every byte verified end to end, no CRC, no sampling), about twice as fast as sha256 per
  core here, and it releases the GIL like hashlib does.
"""
from __future__ import annotations

import hashlib
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Protocol

import blake3

logger = logging.getLogger(__name__)

CHUNK = 8 * 1024 * 1024
BLOCK_SIZE = 1024 * 1024  # the block of formats 2 and 3: transfers align their ranges and parts to it
HASH_THREADS = 4  # file_digest's readers: hashlib and blake3 release the GIL on large buffers
SHA256, BLAKE3 = "sha256", "blake3"
ALGORITHMS = (SHA256, BLAKE3)
ALGORITHM = BLAKE3  # what new checkpoints use (format 3)


class _Hash(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> object: ...
    def digest(self) -> bytes: ...
    def hexdigest(self) -> str: ...


def new_hash(algorithm: str) -> _Hash:
    """A fresh hash object of ``algorithm`` (one of ALGORITHMS)."""
    if algorithm == BLAKE3:
        return blake3.blake3()
    if algorithm == SHA256:
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")


def sha256_file(path: Path) -> tuple[int, str]:
    """Size and hex sha256 of a file, read once in large chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def tagged(algorithm: str, digest: str) -> str:
    """A digest as stored with a remote object: its algorithm named unless sha256, so that objects
    uploaded by older builds (a plain hex sha256-family digest) still compare equal to their entries."""
    return digest if algorithm == SHA256 else f"{algorithm}:{digest}"


def combine(block_digests: list[bytes], algorithm: str = ALGORITHM) -> str:
    """The block digest (formats 2 and 3) of a file from its blocks' digests, in order."""
    combined = new_hash(algorithm)
    combined.update(b"".join(block_digests))
    return combined.hexdigest()


def block_count(size: int, block_size: int) -> int:
    return -(-size // block_size)


def align_up(n: int, block_size: int | None) -> int:
    """``n`` rounded up to whole blocks, so that a range or part of that size holds whole blocks."""
    return n if block_size is None else -(-n // block_size) * block_size


def _block_hash(data: bytes | memoryview, algorithm: str) -> bytes:
    h = new_hash(algorithm)
    h.update(data)
    return h.digest()


def digest_bytes(data: bytes | memoryview, block_size: int | None, algorithm: str = ALGORITHM) -> str:
    if block_size is None:
        return hashlib.sha256(data).hexdigest()
    view = memoryview(data)
    return combine([_block_hash(view[i : i + block_size], algorithm) for i in range(0, len(view), block_size)],
                   algorithm)


def file_digest(path: Path, block_size: int | None, threads: int = HASH_THREADS,
                algorithm: str = ALGORITHM) -> tuple[int, str]:
    """Size and digest of a file; block digests (formats 2 and 3) are read and hashed ``threads`` blocks
    at a time. Format 1 (``block_size`` None) is always a plain sha256."""
    if block_size is None:
        return sha256_file(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        blocks = BlockDigest(size, block_size, algorithm)
        per_thread = threading.local()
        span = max(block_size, align_up(CHUNK, block_size))  # each task reads a few MiB, whole blocks

        def hash_span(offset: int) -> None:
            if not hasattr(per_thread, "buffer"):
                per_thread.buffer = bytearray(min(CHUNK, block_size))
            hash_range(blocks.at(offset), fd, offset, min(span, size - offset), per_thread.buffer)

        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="file-digest") as pool:
            list(pool.map(hash_span, range(0, size, span)))
        return size, blocks.hexdigest()
    finally:
        os.close(fd)


class BlockDigest:
    """The block digest (formats 2 and 3) of a file of known size, fed range by range from any number of
    threads.

    ``at(offset)`` (a block boundary) gives a feeder for the bytes from there on; each block's digest
    is kept as soon as its last byte arrives. A retried range simply asks for a new feeder.
    """

    def __init__(self, size: int, block_size: int, algorithm: str = ALGORITHM) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, not {block_size}")
        new_hash(algorithm)  # an unknown algorithm fails here, not in a transfer's threads
        self.size = size
        self.block_size = block_size
        self.algorithm = algorithm
        self._blocks: list[bytes | None] = [None] * block_count(size, block_size)

    def at(self, offset: int) -> RangeHasher:
        if offset % self.block_size or not 0 <= offset <= self.size:
            raise ValueError(f"offset {offset} is not a block boundary of a {self.size}-byte file")
        return RangeHasher(self, offset)

    def hexdigest(self) -> str:
        missing = [i for i, d in enumerate(self._blocks) if d is None]
        if missing:
            raise ValueError(f"{len(missing)} block(s) never hashed, the first at byte {missing[0] * self.block_size}")
        return combine(self._blocks, self.algorithm)  # type: ignore[arg-type]

    def _done(self, index: int, digest: bytes) -> None:
        self._blocks[index] = digest  # one slot per block: no lock needed


class _BlockFeed:
    """Bytes arriving in order, in any chunk sizes, cut into blocks and each block hashed (one thread).

    Subclasses say how long the current block is and where a finished block's digest goes.
    """

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self._hash = new_hash(algorithm)
        self._filled = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        while view.nbytes:
            block_len = self._block_len()
            take = min(view.nbytes, block_len - self._filled)
            self._hash.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == block_len:
                self._finished(self._hash.digest())
                self._hash, self._filled = new_hash(self.algorithm), 0

    def _block_len(self) -> int:
        raise NotImplementedError

    def _finished(self, digest: bytes) -> None:
        raise NotImplementedError


class RangeHasher(_BlockFeed):
    """Hashes consecutive bytes of a file of known size from a block boundary on."""

    def __init__(self, parent: BlockDigest, offset: int) -> None:
        super().__init__(parent.algorithm)
        self._parent = parent
        self._index = offset // parent.block_size

    def _block_len(self) -> int:
        parent = self._parent
        if self._index >= len(parent._blocks):
            raise ValueError("more bytes than the file holds")
        return min(parent.block_size, parent.size - self._index * parent.block_size)

    def _finished(self, digest: bytes) -> None:
        self._parent._done(self._index, digest)
        self._index += 1


class StreamDigest(_BlockFeed):
    """A digest of bytes arriving in order, of a size not known in advance (a file being written)."""

    def __init__(self, block_size: int | None, algorithm: str = ALGORITHM) -> None:
        super().__init__(SHA256 if block_size is None else algorithm)  # format 1 is a plain sha256
        self.block_size = block_size
        self._blocks: list[bytes] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self.block_size is None:
            self._hash.update(data)
            return
        super().update(data)

    def hexdigest(self) -> str:
        if self.block_size is None:
            return self._hash.hexdigest()
        return combine(self._blocks + ([self._hash.digest()] if self._filled else []), self.algorithm)

    def _block_len(self) -> int:
        assert self.block_size is not None
        return self.block_size

    def _finished(self, digest: bytes) -> None:
        self._blocks.append(digest)


class PartDigest:
    """A file's digest while it moves in parts (ranged GETs, multipart uploads), any format.

    Formats 2 and 3: each part (whole blocks) is hashed by the thread that moves it, through
    ``part(offset)``. Format 1: ``in_order`` is the one sha256 the caller feeds in file order; ``part``
    gives None.
    """

    def __init__(self, size: int, block_size: int | None, algorithm: str = ALGORITHM) -> None:
        self._blocks = BlockDigest(size, block_size, algorithm) if block_size is not None else None
        self.in_order = hashlib.sha256() if block_size is None else None

    def part(self, offset: int) -> RangeHasher | None:
        return self._blocks.at(offset) if self._blocks is not None else None

    def hexdigest(self) -> str:
        if self._blocks is not None:
            return self._blocks.hexdigest()
        assert self.in_order is not None
        return self.in_order.hexdigest()


class HashingWriter:
    """A write-only file wrapper that hashes bytes as they pass, so a file is never re-read to hash it.

    torch.save accepts any object with write/flush; this one also counts the size. ``block_size`` and
    ``algorithm`` choose the digest (see the module docstring); format 3's is the default.
    """

    def __init__(self, raw: BinaryIO, block_size: int | None = BLOCK_SIZE, algorithm: str = ALGORITHM) -> None:
        self._raw = raw
        self._digest = StreamDigest(block_size, algorithm)
        self.block_size = block_size
        self.algorithm = self._digest.algorithm
        self.size = 0
        # The first write error, kept because some writers (torch.save's zip writer) replace it with
        # a RuntimeError while cleaning up, and the caller needs the real cause (ENOSPC, EFBIG, EIO).
        self.error: OSError | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        try:
            written = self._raw.write(view)
        except OSError as e:
            self.error = self.error or e
            raise
        self._digest.update(view)
        self.size += view.nbytes
        return written

    def flush(self) -> None:
        self._raw.flush()

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (to make a rename or a new entry in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_range(digest: "hashlib._Hash | RangeHasher", fd: int, offset: int, length: int, buffer: bytearray) -> None:
    """Feed ``length`` bytes of ``fd`` from ``offset`` into ``digest``, through one reused buffer.

    Reading back from the page cache costs a memory copy; a new buffer per range would cost fresh
    pages, which on a VM can cost more than the copy (BENCHMARKS.md, "Fresh memory is expensive").
    """
    view = memoryview(buffer)
    end = offset + length
    while offset < end:
        n = os.preadv(fd, [view[: min(len(view), end - offset)]], offset)
        if n == 0:
            raise EOFError(f"file ends at {offset}, expected {end} bytes")
        digest.update(view[:n])
        offset += n


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written
