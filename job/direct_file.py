"""A checkpoint file written around the page cache (O_DIRECT), through a small aligned staging buffer.

Why: a buffered write copies every byte into fresh page-cache pages that the kernel then writes back
on its own threads, at training's priority, and the pages stay in memory, charged to the job's memory
cgroup, until the previous checkpoint is pruned and frees them again. None of that helps: a checkpoint
is read back once, by the uploader, if at all. Here the writer copies each write into one reused,
page-aligned buffer (a storage by a memmove that releases the GIL) and hands full buffers to the device
directly.
Measured on the 2-vCPU benchmark VM (BENCHMARKS.md, thirteenth session): a 100 MB ``_write_file`` took
40-70 ms of CPU this way against 53-306 ms through the page cache, whose cost there depends on whether
the pages freed by the last prune must first come back from the host.

O_DIRECT wants the buffer, the file offset and the length aligned to the device's logical block
(512 B or 4 KiB); ALIGN covers both. The last, partial block is written padded to it and the
file truncated to its size before the fsync, so the file holds exactly what was written. A filesystem
that refuses O_DIRECT (at open, or EINVAL at a write: a larger alignment, a FUSE mount) gets the same
bytes through the page cache instead; the caller cannot tell but by :attr:`DirectFile.direct`.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import threading
from pathlib import Path
from types import TracebackType

from uploader.hashing import align_up

logger = logging.getLogger(__name__)

ALIGN = 4096
STAGING_BYTES = 8 << 20  # one device write; a multiple of ALIGN
SMALL_WRITE = 64 << 10  # copied under the GIL; larger ones by a memmove that releases it
_O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux; elsewhere every file is buffered


class _PyBuffer(ctypes.Structure):
    """CPython's Py_buffer (part of the limited API since 3.11): only ``buf``, the address, is read."""

    _fields_ = [("buf", ctypes.c_void_p), ("obj", ctypes.c_void_p), ("len", ctypes.c_ssize_t),
                ("itemsize", ctypes.c_ssize_t), ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
                ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
                ("suboffsets", ctypes.c_void_p), ("internal", ctypes.c_void_p)]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]


def _address(view: memoryview) -> int:
    """The address of a contiguous buffer, read-only ones too (torch.save hands out read-only views of
    tensor storage, which ctypes' from_buffer refuses)."""
    buffer = _PyBuffer()
    _get_buffer(view, ctypes.byref(buffer), 0)  # PyBUF_SIMPLE: contiguous bytes; raises if it is not
    try:
        return int(buffer.buf or 0)
    finally:
        _release_buffer(ctypes.byref(buffer))


class _Staging:
    """Staging buffers reused from one file to the next: fresh memory costs page faults, and on a VM that
    hands freed pages back to its host, much more (BENCHMARKS.md, "Machine")."""

    def __init__(self, keep: int = 2) -> None:
        self._free: list[mmap.mmap] = []
        self._keep = keep
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, STAGING_BYTES)  # anonymous, page-aligned

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buffer)
                return
        buffer.close()


_staging = _Staging()


class DirectFile:
    """A new file at ``path`` (truncated if it exists), written around the page cache where the filesystem
    allows. File-like enough for torch.save through uploader.hashing.HashingWriter: ``write`` and
    ``flush``. :meth:`sync` makes it durable; without it (an error), :meth:`close` leaves a partial file."""

    def __init__(self, path: Path) -> None:
        self.direct = bool(_O_DIRECT)
        self._path = path
        self._buffer: mmap.mmap | None = _staging.take()
        self._view = memoryview(self._buffer)
        self._base = _address(self._view)
        try:
            self._fd = self._open()
        except BaseException:
            self._view.release()
            _staging.give(self._buffer)
            raise
        self._fill = 0  # bytes staged, not yet written
        self.size = 0  # bytes accepted

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        n = view.nbytes
        source = _address(view) if n >= SMALL_WRITE else 0
        done = 0
        while done < n:
            take = min(n - done, STAGING_BYTES - self._fill)
            if take < SMALL_WRITE:  # torch.save's headers: no foreign call, no GIL hand-over per write
                self._view[self._fill : self._fill + take] = view[done : done + take]
            else:  # a storage: the copy releases the GIL, as a write to a file does
                ctypes.memmove(self._base + self._fill, source + done, take)
            self._fill += take
            done += take
            if self._fill == STAGING_BYTES:
                self._drain(STAGING_BYTES)
        self.size += n
        return n

    def flush(self) -> None:
        """Nothing: what is staged goes out in whole buffers, the rest at :meth:`sync`."""

    def sync(self) -> None:
        """Write what is staged (its last block padded, then cut off by a truncate) and fsync."""
        if self._fill:
            tail = self._fill
            padded = align_up(tail, ALIGN) if self.direct else tail  # what pads it is cut off below
            self._drain(padded)
            if padded != tail:
                os.ftruncate(self._fd, self.size)
        os.fsync(self._fd)

    def close(self) -> None:
        if self._buffer is None:
            return
        self._view.release()
        _staging.give(self._buffer)
        self._buffer = None
        os.close(self._fd)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def _open(self) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            return os.open(self._path, flags | _O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
        self._buffered("open")
        return os.open(self._path, flags, 0o644)

    def _drain(self, length: int) -> None:
        """Write the first ``length`` staged bytes at the end of the file."""
        written = 0
        while written < length:
            try:
                written += os.write(self._fd, self._view[written:length])
            except OSError as e:
                # EINVAL from a direct write: the device wants a larger alignment than ALIGN, or a file
                # size limit cut the write to a length off the alignment. The same bytes through the
                # page cache either go through or fail with the real cause (EFBIG, ENOSPC).
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self._go_buffered()
        self._fill = 0

    def _go_buffered(self) -> None:
        fcntl.fcntl(self._fd, fcntl.F_SETFL, fcntl.fcntl(self._fd, fcntl.F_GETFL) & ~_O_DIRECT)
        self._buffered("write")

    def _buffered(self, where: str) -> None:
        self.direct = False
        logger.debug("O_DIRECT refused (%s) for %s: written through the page cache", where, self._path)
