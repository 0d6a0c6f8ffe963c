"""sha256 of files, computed while they are written or in one streaming read; writeback hints."""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import logging
import os
from pathlib import Path
from typing import BinaryIO, Callable

logger = logging.getLogger(__name__)

CHUNK = 8 * 1024 * 1024


def sha256_file(path: Path) -> tuple[int, str]:
    """Size and hex sha256 of a file, read once in large chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


class HashingWriter:
    """A write-only file wrapper that hashes bytes as they pass, so a file is never re-read to hash it.

    torch.save accepts any object with write/flush; this one also counts the size.
    """

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        self._digest = hashlib.sha256()
        self.size = 0
        # The first write error, kept because some writers (torch.save's zip writer) replace it with
        # a RuntimeError while cleaning up, and the caller needs the real cause (ENOSPC, EFBIG, EIO).
        self.error: OSError | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
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


def hash_range(digest: "hashlib._Hash", fd: int, offset: int, length: int, buffer: bytearray) -> None:
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


_SYNC_FILE_RANGE_WRITE = 2


def _load_sync_file_range() -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a finished range to disk now, without waiting (Linux only).

    The final fsync then has little left to do, instead of flushing a whole download at the end.
    It is only a hint: durability still comes from that fsync, so failures are ignored.
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)
