"""job.direct_file: checkpoint files written around the page cache hold exactly the bytes written."""
from __future__ import annotations

import errno
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from job import direct_file
from job.checkpoint import _write_file
from job.direct_file import ALIGN, STAGING_BYTES, DirectFile
from tests.support.checkpoints import cached_pages
from tests.support.jobs import REPO
from uploader.hashing import file_digest

SIZES = [0, 1, ALIGN - 1, ALIGN, ALIGN + 1, STAGING_BYTES - 1, STAGING_BYTES, 2 * STAGING_BYTES + 12345]


def _pieces(total: int, seed: int) -> list[bytes]:
    """``total`` random bytes cut at random points: torch.save's writes are headers of a few bytes
    between storages of any size."""
    rng = random.Random(seed)
    data = rng.randbytes(total)
    cuts = sorted(rng.sample(range(1, total), min(total - 1, 20))) if total > 1 else []
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, total])]


def _write(path: Path, pieces: list[bytes]) -> bool:
    with DirectFile(path) as f:
        for piece in pieces:
            assert f.write(memoryview(piece)) == len(piece)
        f.flush()
        f.sync()
        return f.direct


@pytest.fixture
def direct_capable(tmp_path: Path) -> Path:
    """tmp_path, where its filesystem takes O_DIRECT (ext4 and xfs do; some overlay and FUSE mounts do not)."""
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError as e:
        pytest.skip(f"{tmp_path} does not take O_DIRECT ({e.strerror}); the fallback tests still run")
    return tmp_path


@pytest.mark.parametrize("size", SIZES)
def test_the_file_holds_exactly_the_bytes_written(direct_capable, size):
    pieces = _pieces(size, seed=size)
    path = direct_capable / "f.bin"
    assert _write(path, pieces) is True
    assert path.read_bytes() == b"".join(pieces)


def test_a_shorter_file_after_a_longer_one_has_nothing_of_it(direct_capable):
    """The staging buffer is reused and the last block is padded with whatever it holds: the truncate
    must cut all of that off."""
    long, short = direct_capable / "long", direct_capable / "short"
    _write(long, [b"\xff" * (STAGING_BYTES + 3 * ALIGN + 17)])
    _write(short, [b"a" * 5])
    assert short.read_bytes() == b"aaaaa"
    assert long.stat().st_size == STAGING_BYTES + 3 * ALIGN + 17


def test_the_written_file_is_not_left_in_the_page_cache(direct_capable):
    data = os.urandom(4 * STAGING_BYTES + 100)
    plain, direct = direct_capable / "plain", direct_capable / "direct"
    plain.write_bytes(data)
    assert cached_pages(plain) > 0  # the measure sees a buffered write
    _write(direct, [data])
    assert cached_pages(direct) <= 1  # at most the tail block, written last


def test_a_checkpoint_file_is_written_around_the_page_cache(direct_capable):
    tree = {"w": torch.randn(3 * STAGING_BYTES // 4 + 7), "step": 3}
    path = direct_capable / "state.pt"
    entry = _write_file(path, tree)
    assert cached_pages(path) <= 1
    assert file_digest(path, entry.block_size)[1] == entry.digest
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["w"], tree["w"]) and loaded["step"] == 3


def test_a_filesystem_refusing_o_direct_at_open_gets_a_buffered_file(tmp_path, monkeypatch):
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    pieces = _pieces(STAGING_BYTES + 5000, seed=1)
    path = tmp_path / "f.bin"
    assert _write(path, pieces) is False
    assert path.read_bytes() == b"".join(pieces)


def _fake_write(monkeypatch, fail):
    """os.write that calls ``fail(data)`` for direct writes first: it may raise, or return how many
    bytes to write for real (None for all)."""
    real_write = os.write

    def write(fd, data):
        if direct_file.fcntl.fcntl(fd, direct_file.fcntl.F_GETFL) & os.O_DIRECT:
            n = fail(data)
            if n is not None:
                return real_write(fd, memoryview(data)[:n])
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)


def test_a_direct_write_refused_with_einval_goes_through_the_page_cache(direct_capable, monkeypatch):
    """A device whose logical block is larger than ALIGN refuses the write, not the open."""
    calls = []

    def refuse(data):
        calls.append(len(data))
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    _fake_write(monkeypatch, refuse)
    pieces = _pieces(2 * STAGING_BYTES + 77, seed=2)
    path = direct_capable / "f.bin"
    assert _write(path, pieces) is False
    assert calls == [STAGING_BYTES]  # refused once, then never tried again
    assert path.read_bytes() == b"".join(pieces)


def test_short_direct_writes_go_on_from_where_they_stopped(direct_capable, monkeypatch):
    calls = []

    def short(data):
        calls.append(len(data))
        return min(len(data), 3 * ALIGN)

    _fake_write(monkeypatch, short)
    pieces = _pieces(STAGING_BYTES + 3, seed=3)
    path = direct_capable / "f.bin"
    assert _write(path, pieces) is True
    assert path.read_bytes() == b"".join(pieces)
    assert calls[:3] == [STAGING_BYTES, STAGING_BYTES - 3 * ALIGN, STAGING_BYTES - 6 * ALIGN]


def test_a_size_limit_inside_a_direct_write_fails_with_efbig(direct_capable):
    """RLIMIT_FSIZE cuts a direct write to a length off the alignment, which the kernel refuses (EINVAL);
    the page cache then reports the real cause, as a full disk would be reported. In a child process:
    the limit is per process."""
    script = f"""
import errno, resource, signal, sys
from job.direct_file import DirectFile
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ({STAGING_BYTES} + 1000, {STAGING_BYTES} + 1000))
try:
    with DirectFile(sys.argv[1]) as f:
        f.write(b"x" * {2 * STAGING_BYTES})
except OSError as e:
    sys.exit(0 if e.errno == errno.EFBIG and not f.direct else 3)
sys.exit(4)
"""
    done = subprocess.run([sys.executable, "-c", script, str(direct_capable / "f.bin")], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (direct_capable / "f.bin").stat().st_size == STAGING_BYTES + 1000


def test_a_full_disk_is_raised_as_itself(direct_capable, monkeypatch):
    def full(data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    _fake_write(monkeypatch, full)
    with pytest.raises(OSError) as caught, DirectFile(direct_capable / "f.bin") as f:
        f.write(b"x" * STAGING_BYTES)
    assert caught.value.errno == errno.ENOSPC


def test_a_file_that_cannot_be_created_raises_as_itself(tmp_path):
    with pytest.raises(FileNotFoundError):
        DirectFile(tmp_path / "no-such-folder" / "f.bin")
