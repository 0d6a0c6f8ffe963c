"""uploader.destination: a download's file, its space reserved first, its local failures named."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from tests.support.disk import fake_fallocate
from uploader import destination
from uploader.destination import Destination, reserve
from uploader.exceptions import LocalWriteError

MiB = 1024 * 1024


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_the_whole_size_is_on_disk_before_the_first_byte(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    with open(probe, "wb") as f:
        if not reserve(f.fileno(), MiB):
            pytest.skip("this filesystem has no fallocate")
    with Destination(tmp_path / "state.pt", 8 * MiB) as dest:
        st = os.stat(dest.path)
        assert st.st_size == 8 * MiB
        assert st.st_blocks * 512 >= 8 * MiB  # allocated, not a sparse hole that a full disk fails later


def test_a_disk_without_room_fails_before_anything_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    call, asked = fake_fallocate(errno.ENOSPC)
    monkeypatch.setattr(destination, "_fallocate", call)
    before = open_fds()
    with pytest.raises(LocalWriteError) as raised:
        Destination(tmp_path / "state.pt", 3 * MiB)
    assert str(raised.value) == f"cannot write {tmp_path / 'state.pt'}: No space left on device"
    assert raised.value.reason == "No space left on device"
    assert asked == [3 * MiB]
    assert open_fds() == before  # its descriptor is closed again


@pytest.mark.parametrize("answer", [errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL])
def test_a_filesystem_without_fallocate_still_gets_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            answer: int) -> None:
    call, asked = fake_fallocate(answer)
    monkeypatch.setattr(destination, "_fallocate", call)
    with Destination(tmp_path / "state.pt", 2 * MiB) as dest:
        dest.write(b"a" * MiB)
        dest.write(b"b" * MiB)
    assert asked == [2 * MiB]
    assert (tmp_path / "state.pt").read_bytes() == b"a" * MiB + b"b" * MiB


def test_an_interrupted_reservation_is_asked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    call, asked = fake_fallocate(errno.EINTR, 0)
    monkeypatch.setattr(destination, "_fallocate", call)
    Destination(tmp_path / "state.pt", MiB).close()
    assert asked == [MiB, MiB]


def test_an_existing_file_is_sized_and_keeps_its_reserved_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A placeholder made with its room reserved (uploader.sync) is opened as it is, not emptied: emptying
    it would give the room back, for anyone to take, before it is reserved again."""
    path = tmp_path / "state.pt"
    path.write_bytes(b"x" * (3 * MiB))
    with Destination(path, MiB) as dest:
        blocks = os.stat(path).st_blocks
        dest.write(b"y" * 10)
    assert path.read_bytes() == b"y" * 10 + b"x" * (MiB - 10)  # the download writes every byte again
    assert blocks * 512 >= MiB


def test_a_failing_write_is_a_local_write_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: memoryview, offset: int) -> int:
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    with Destination(tmp_path / "state.pt", MiB) as dest:
        monkeypatch.setattr(os, "pwrite", full)
        with pytest.raises(LocalWriteError, match=f"^cannot write {tmp_path / 'state.pt'}: Disk quota exceeded$"):
            dest.write(b"z" * 100)


def test_a_folder_that_cannot_hold_files_is_a_local_write_error(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(LocalWriteError, match="Not a directory$"):
        Destination(tmp_path / "a-file" / "state.pt", MiB)


def close_reporting(monkeypatch: pytest.MonkeyPatch, err: int) -> None:
    """os.close closes, then reports ``err``, as NFS does for a write it could not store (ENOSPC, EDQUOT)."""
    real = os.close

    def close(fd: int) -> None:
        real(fd)
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(destination.os, "close", close)


def test_a_full_disk_reported_only_at_close_is_a_local_write_error(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    dest = Destination(tmp_path / "state.pt", 10)
    dest.write(b"0123456789")
    close_reporting(monkeypatch, errno.EDQUOT)
    with pytest.raises(LocalWriteError, match="Disk quota exceeded$"):
        dest.close()
    dest.close()  # once only: the descriptor number may already belong to another file


def test_an_error_already_in_flight_is_not_replaced_by_the_close(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="the first failure"):
        with Destination(tmp_path / "state.pt", 10):
            close_reporting(monkeypatch, errno.ENOSPC)
            raise ValueError("the first failure")


def test_a_link_left_at_the_path_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"not yours")
    (tmp_path / "state.pt").symlink_to(elsewhere)
    with pytest.raises(LocalWriteError, match="Too many levels of symbolic links$"):
        Destination(tmp_path / "state.pt", 3)
    assert elsewhere.read_bytes() == b"not yours"


def test_an_empty_file_needs_no_reservation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    call, asked = fake_fallocate(errno.ENOSPC)
    monkeypatch.setattr(destination, "_fallocate", call)
    Destination(tmp_path / "empty", 0).close()
    assert asked == [] and (tmp_path / "empty").read_bytes() == b""
