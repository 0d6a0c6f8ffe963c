"""sha256 of files, computed while they are written or in one streaming read."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO

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
