"""The download's stream helper on bodies without urllib3's socket path (the fallback) and short ones."""
from __future__ import annotations

import http.client
import io
import os
import ssl
import threading
from pathlib import Path

import pytest

from uploader.retry import is_transient
from uploader.config import MiB, UploadConfig
from uploader.destination import Destination
from uploader.exceptions import LocalWriteError
from uploader.s3 import MAX_GET_RANGE, _range_problem, _stream_into, get_range_size


class PlainBody:
    """A body with only ``read(n)``, as a response from another HTTP stack would be."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)

    def read(self, n: int) -> bytes:
        return self._data.read(n)


def test_a_plain_body_lands_at_its_offset_through_the_small_buffer(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    path = tmp_path / "file"
    with Destination(path, 12_000) as dest:
        _stream_into(PlainBody(data), dest, 1_000, len(data), bytearray(4096), threading.Lock())
    written = path.read_bytes()
    assert written[1_000:11_000] == data
    assert written[:1_000] == written[11_000:] == b"\0" * 1_000


def test_a_body_that_ends_early_is_a_transient_error(tmp_path: Path) -> None:
    with Destination(tmp_path / "file", 1_000) as dest, pytest.raises(http.client.IncompleteRead) as raised:
        _stream_into(PlainBody(b"x" * 100), dest, 0, 1_000, bytearray(64), threading.Lock())
    assert is_transient(raised.value)


class FailingBody(PlainBody):
    """A body whose connection fails after its first bytes."""

    def __init__(self, error: OSError) -> None:
        super().__init__(b"x" * 100)
        self.error = error

    def read(self, n: int) -> bytes:
        data = super().read(n)
        if not data:
            raise self.error
        return data


@pytest.mark.parametrize("error", [ConnectionResetError(104, "Connection reset by peer"),
                                   ssl.SSLError(1, "[SSL: DECRYPTION_FAILED_OR_BAD_RECORD_MAC]")])
def test_a_connection_failing_mid_body_is_the_networks_error_not_the_local_disks(tmp_path: Path,
                                                                                 error: OSError) -> None:
    """Both are OSErrors, like a full disk: only the writes to the file count as the local disk's."""
    with Destination(tmp_path / "file", 1_000) as dest, pytest.raises(type(error)) as raised:
        _stream_into(FailingBody(error), dest, 0, 1_000, bytearray(64), threading.Lock())
    assert raised.value is error and not isinstance(raised.value, LocalWriteError)


@pytest.mark.parametrize(("size", "expected"), [
    (10 * MiB, 16 * MiB),  # small: never below a part
    (256 * MiB, 16 * MiB),  # two 16 MiB ranges per worker already
    (512 * MiB, 32 * MiB),  # two ranges per worker, longer
    (1024 * MiB, 64 * MiB),
    (10 * 1024 * MiB, MAX_GET_RANGE),  # a large file: capped, so a retry refetches at most 64 MiB
])
def test_ranged_gets_are_about_two_per_worker_between_a_part_and_the_cap(size: int, expected: int) -> None:
    config = UploadConfig(part_size=16 * MiB, concurrency=8)
    assert get_range_size(size, config) == expected
    assert get_range_size(size, UploadConfig(part_size=128 * MiB)) == 128 * MiB  # a configured part wins


@pytest.mark.parametrize(("reply", "problem"), [
    ({"ContentRange": "bytes 100-199/1000", "ContentLength": 100}, None),
    ({"ContentRange": "bytes 100-199/900", "ContentLength": 100}, "got bytes 100-199/900"),  # a shorter object
    ({"ContentRange": "bytes 100-149/1000", "ContentLength": 50}, "got bytes 100-149/1000"),
    ({"ContentRange": "bytes 100-199/*", "ContentLength": 100}, "got bytes 100-199/*"),
    ({"ContentRange": "pages 1-2/3", "ContentLength": 100}, "Content-Range is 'pages 1-2/3'"),
    ({"ContentLength": 1000}, "no Content-Range"),  # the whole object for a range of it: Range ignored
])
def test_a_reply_that_is_not_the_range_asked_for_names_what_it_is(reply: dict, problem: str | None) -> None:
    """What a server that ignores If-Match, or Range, answers once the object changed: told apart from the
    range asked for by Content-Range, never written into the file as if it were it."""
    found = _range_problem(reply, 100, 199, 1000)
    assert found == problem if problem is None else (found is not None and problem in found)


def test_a_whole_object_without_content_range_is_the_one_range_asked_for() -> None:
    assert _range_problem({"ContentLength": 1000}, 0, 999, 1000) is None
    assert _range_problem({"ContentLength": 900}, 0, 999, 1000) is not None
