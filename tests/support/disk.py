"""A disk that runs out of room. In-process, for downloads: fallocate(2) answering as told, and local
writes that fail with ENOSPC once a given number of bytes went through (the bytes before are really
written). For a child process: a file size limit (RLIMIT_FSIZE), past which writes fail with EFBIG."""
from __future__ import annotations

import ctypes
import errno
import os
import resource
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from uploader import destination, hashing, s3
from uploader.progress import human_bytes


def fake_fallocate(*answers: int) -> tuple[Callable[..., int], list[int]]:
    """A stand-in for fallocate(2) that answers with the given errnos in turn (0, or none left: success),
    the way the C function does: -1 with errno set. Returns it and the sizes it was asked for."""
    asked: list[int] = []
    left = list(answers)

    def call(fd: int, mode: int, offset: int, size: int) -> int:
        asked.append(size)
        err = left.pop(0) if left else 0
        ctypes.set_errno(err)
        return -1 if err else 0

    return call, asked


def fill_disk_after(monkeypatch: pytest.MonkeyPatch, room: int) -> list[int]:
    """Make every download's local writes (both remotes' paths) fail with ENOSPC once ``room`` bytes are
    written; returns the sizes of the writes that went through."""
    written: list[int] = []
    lock = threading.Lock()

    def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
        with lock:
            if sum(written) + len(data) > room:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written.append(len(data))
        hashing.pwrite_all(fd, data, offset)

    monkeypatch.setattr(s3, "pwrite_all", pwrite_all)
    monkeypatch.setattr(destination, "pwrite_all", pwrite_all)
    return written


def limit_file_size(limit: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child may write no file past ``limit`` bytes, like a disk with that room."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG, not kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


NO_SPACE = "No space left on device; make room there or use another folder"
FILE_TOO_LARGE = "File too large; raise the file size limit (ulimit -f) or use another filesystem"  # RLIMIT_FSIZE


def pull_refused(name: str, size: int, folder: Path, why: str) -> str:
    """The line a pull ends with when the local disk refuses it (uploader.sync), ``why`` being the system's
    reason and the advice (NO_SPACE, FILE_TOO_LARGE)."""
    return f"cannot download {name} ({human_bytes(size)}) into {folder}: {why} (the remote checkpoint is untouched)"
