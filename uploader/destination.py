"""The local file a download lands in: its whole size reserved before the first byte is fetched, and a
failed local write named as such.

A pull onto a disk that cannot hold the checkpoint (a spot node that came back with a smaller disk, a
volume filled by something else) must end with one line saying so, and the documented exit code
(README, "Exit codes"), not as a network failure or a traceback: every local write of a download
raises LocalWriteError. Reserving the size first (``fallocate(2)``) makes such a disk fail at once,
before a gigabyte is fetched and thrown away, rather than near the end of the download.

glibc's ``posix_fallocate`` is not used: on a filesystem without ``fallocate`` (some FUSE and network
mounts) it emulates the call by writing into every block of the file, a second write of the whole
download. There the reservation is skipped, and a full disk shows at the write that meets it.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

from uploader.exceptions import LocalWriteError
from uploader.hashing import pwrite_all

logger = logging.getLogger(__name__)

# fallocate(2) answers these on filesystems that do not implement it: skip the reservation there.
_UNSUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL})


def _load_fallocate() -> ctypes._CFuncPtr | None:
    # The process's own symbols hold libc's (glibc and musl): no library search, which would run
    # `ldconfig -p` in a subprocess at import. glibc's fallocate64 takes 64-bit offsets on 32-bit
    # builds too; where only fallocate exists (musl, 64-bit glibc) off_t is 64 bits already.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate64 if hasattr(libc, "fallocate64") else libc.fallocate
    except (OSError, AttributeError):  # not Linux: no reservation
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate = _load_fallocate()


def reserve(fd: int, size: int) -> bool:
    """Allocate ``size`` bytes of disk for ``fd`` (the file grows to ``size`` if it was shorter); False
    where the filesystem cannot, OSError (ENOSPC, EDQUOT, EFBIG) where the space is not there."""
    if size <= 0:
        return True
    if _fallocate is None:
        return False
    while _fallocate(fd, 0, 0, size) != 0:
        err = ctypes.get_errno()
        if err == errno.EINTR:
            continue
        if err in _UNSUPPORTED:
            return False
        raise OSError(err, os.strerror(err))
    return True


@contextlib.contextmanager
def local_writes(where: Path) -> Iterator[None]:
    """Turn an OSError of the block into LocalWriteError: the local disk (at ``where``) failed, not the
    remote, whose own errors are StorageError."""
    try:
        yield
    except OSError as e:
        reason = e.strerror or str(e)
        raise LocalWriteError(f"cannot write {where}: {reason}", reason, e.errno) from None


class Destination:
    """A download's file: created (or an existing one resized) at its final size with that space reserved,
    written at offsets by any number of threads (``pwrite``) or in order (``write``). Every OSError of
    the local side is a LocalWriteError naming the file."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self._offset = 0  # where write() appends
        with self.writing():
            # Never through a link left at the path: the file is ours to create (ELOOP otherwise). Not
            # truncated: a placeholder made with its room reserved (uploader.sync) keeps that room, and
            # the download writes every byte of it again.
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            with self.writing():
                os.ftruncate(self.fd, size)  # every range can land in place, in any order
                if not reserve(self.fd, size):
                    logger.debug("%s: no fallocate on this filesystem; space is not reserved ahead", path)
        except BaseException:
            os.close(self.fd)
            raise

    def writing(self) -> contextlib.AbstractContextManager[None]:
        return local_writes(self.path)

    def write(self, data: bytes | memoryview) -> int:
        with self.writing():
            pwrite_all(self.fd, memoryview(data), self._offset)
        self._offset += len(data)
        return len(data)

    @property
    def name(self) -> str:
        return str(self.path)

    def fileno(self) -> int:
        return self.fd

    def flush(self) -> None:
        """Nothing is buffered here (file-object compatibility for uploader.filesystem's copy)."""

    def close(self) -> None:
        """Close once; a network filesystem may report a full disk only here (NFS: ENOSPC, EDQUOT)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with self.writing():
                os.close(fd)

    def __enter__(self) -> Destination:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.close()
        except LocalWriteError:
            if exc is None:
                raise  # otherwise the error already in flight is the one to report
