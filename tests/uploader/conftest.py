"""Fixtures of the uploader tests: a Remote of each kind, behind the same interface."""
from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.s3server import READER, Bucket, fast_config, isolated_aws_env
from uploader.remote import Remote, open_remote


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def remote(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Remote]:
    """The protocol must behave the same on a shared volume and on S3 (the session SeaweedFS)."""
    if request.param == "file":
        r = open_remote(f"file://{tmp_path / 'remote'}", fast_config())
    else:
        bucket: Bucket = request.getfixturevalue("s3_bucket")
        r = open_remote(bucket.url(), fast_config(bucket.endpoint_url))
    yield r
    r.close()


@pytest.fixture
def local(tmp_path: Path) -> Path:
    """The job's checkpoint folder."""
    return tmp_path / "local"


@pytest.fixture
def restore(tmp_path: Path) -> Path:
    """Where a (new) pod pulls checkpoints to."""
    return tmp_path / "restore"


@pytest.fixture
def reader_remote(s3_bucket: Bucket, monkeypatch: pytest.MonkeyPatch) -> Iterator[Remote]:
    """The bucket's ``run`` prefix seen with credentials that may list and read, nothing else."""
    for name, value in isolated_aws_env(READER).items():
        monkeypatch.setenv(name, value)
    r = open_remote(s3_bucket.url("run"), fast_config(s3_bucket.endpoint_url))
    yield r
    r.close()


@pytest.fixture
def immutable_folder(tmp_path: Path) -> Iterator[Path]:
    """A folder nobody may add to, root included (chattr +i): tests and CI run as root, whom plain
    permissions never stop. Skipped where the file system or the sandbox refuses the attribute."""
    folder = tmp_path / "immutable"
    folder.mkdir()
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        yield folder
    finally:
        subprocess.run([chattr, "-i", str(folder)], check=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem with 8 MiB of room (a tmpfs), where writes past it fail with a real ENOSPC.
    Skipped where this process may not mount one (not root, or a sandbox without CAP_SYS_ADMIN)."""
    with _tmpfs(tmp_path / "small-disk") as folder:
        yield folder


@pytest.fixture
def read_only_volume(tmp_path: Path) -> Iterator[Path]:
    """A folder ``remote`` on a filesystem mounted read-only (a tmpfs remounted ``ro``): every write fails
    with a real EROFS, root's included. Skipped where this process may not mount one."""
    with _tmpfs(tmp_path / "read-only") as folder:
        (folder / "remote").mkdir()
        if subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True).returncode:
            pytest.skip("cannot remount a tmpfs read-only here")
        yield folder / "remote"


@contextlib.contextmanager
def _tmpfs(folder: Path) -> Iterator[Path]:
    folder.mkdir()
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if mount is None or umount is None or subprocess.run(
            [mount, "-t", "tmpfs", "-o", "size=8m", "spot-trainer-test", str(folder)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        yield folder
    finally:  # a file still open there (a failed test's) makes it busy: then detach it lazily
        if subprocess.run([umount, str(folder)], capture_output=True).returncode:
            subprocess.run([umount, "-l", str(folder)], check=True)
