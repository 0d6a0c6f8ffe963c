"""The download's stream helper on bodies without urllib3's socket path (the fallback) and short ones."""
from __future__ import annotations

import http.client
import io
import os
import threading
from pathlib import Path

import pytest

from uploader.retry import is_transient
from uploader.s3 import _stream_into


class PlainBody:
    """A body with only ``read(n)``, as a response from another HTTP stack would be."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def read(self, n: int) -> bytes:
        return self._data.read(n)


def test_a_plain_body_lands_at_its_offset_through_the_small_buffer(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    path = tmp_path / "file"
    path.write_bytes(b"\0" * 12_000)
    fd = os.open(path, os.O_RDWR)
    try:
        _stream_into(PlainBody(data), fd, 1_000, len(data), bytearray(4096), threading.Lock())
    finally:
        os.close(fd)
    written = path.read_bytes()
    assert written[1_000:11_000] == data
    assert written[:1_000] == written[11_000:] == b"\0" * 1_000


def test_a_body_that_ends_early_is_a_transient_error(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "file", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(http.client.IncompleteRead) as raised:
            _stream_into(PlainBody(b"x" * 100), fd, 0, 1_000, bytearray(64), threading.Lock())
    finally:
        os.close(fd)
    assert is_transient(raised.value)
