"""The start-up write check (uploader.probe), and the refusals it must turn into exit 3: both remotes,
read-only credentials, a refused delete, a folder this user may not write, a dead endpoint, a probe
object left behind."""
from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest

from tests.support.checkpoints import complete_steps, make_checkpoint
from tests.support.s3server import ADMIN, LOOPBACK, READER, Bucket, SeaweedFS, fast_config
from uploader.exceptions import AuthError, RemoteInTheWay, StorageError
from uploader.layout import LATEST_KEY, checkpoint_of
from uploader.probe import PROBE_BODY, PROBE_PREFIX, check_writable
from uploader.remote import Remote, open_remote
from uploader.s3 import S3Remote
from uploader.sync import list_remote, pull_newest, push


def test_a_writable_remote_passes_and_keeps_nothing(remote: Remote) -> None:
    check_writable(remote)
    check_writable(remote)
    assert remote.list() == []


@pytest.mark.s3
def test_read_only_credentials_fail_the_check_with_one_line(s3_bucket: Bucket, reader_remote: Remote) -> None:
    assert reader_remote.list() == []  # it may list: only the write check finds what is missing

    with pytest.raises(AuthError) as refused:
        check_writable(reader_remote)

    line = str(refused.value)
    assert "\n" not in line and line.startswith(f"{s3_bucket.url('run')} is not writable (start-up write check)")
    assert "AccessDenied" in line and s3_bucket.endpoint_url in line and "write and delete" in line
    assert READER.secret_key not in line


@pytest.mark.s3
def test_a_refused_delete_is_a_permission_error(s3_server: SeaweedFS, s3_bucket: Bucket, reader_remote: Remote) -> None:
    """S3 refuses DeleteObjects key by key inside a 200 reply; retention must still exit 3, not 1."""
    admin = S3Remote(s3_bucket.name, "run", fast_config(s3_bucket.endpoint_url), client=s3_server.client(ADMIN))
    admin.write_bytes("kept", b"still here")

    with pytest.raises(AuthError, match=r"refused to delete 1 object\(s\), e\.g\. run/kept: AccessDenied"):
        reader_remote.delete(["kept"])
    assert admin.read_bytes("kept") == b"still here"
    admin.close()


def test_a_file_remote_that_cannot_be_created_keeps_its_error_type(tmp_path: Path) -> None:
    (tmp_path / "remote").write_text("a file where the remote folder should be")
    remote = open_remote(f"file://{tmp_path / 'remote'}", fast_config())

    with pytest.raises(StorageError, match=r"is not writable \(start-up write check\): cannot create") as failed:
        check_writable(remote)
    assert type(failed.value) is RemoteInTheWay  # the remote's own error (exit 6: remove it), not an AuthError
    assert (tmp_path / "remote").read_text() == "a file where the remote folder should be"


def test_a_file_remote_this_user_may_not_write_is_a_permission_error(immutable_folder: Path) -> None:
    remote = open_remote(f"file://{immutable_folder}", fast_config())

    with pytest.raises(AuthError, match=r"is not writable \(start-up write check\): cannot write .*"
                                        r"Operation not permitted; this user \(uid \d+\) needs to read and write"):
        check_writable(remote)
    assert list(immutable_folder.iterdir()) == []


def test_a_file_remote_on_a_read_only_volume_is_a_permission_error(read_only_volume: Path) -> None:
    """The folder exists, so the check gets as far as writing its file: the clean-up of that temporary file
    failed with EROFS as well, and its OSError replaced the refusal (job train: a traceback, exit 1)."""
    remote = open_remote(f"file://{read_only_volume}", fast_config())

    with pytest.raises(AuthError, match=r"is not writable \(start-up write check\): cannot write .*"
                                        r"Read-only file system; this user \(uid \d+\) needs to read and write"):
        check_writable(remote)


def test_an_unreachable_endpoint_is_logged_not_raised(aws_env: object, caplog: pytest.LogCaptureFixture) -> None:
    """Storage that is down is the retrying uploads' business; the check only reports it."""
    with socket.socket() as unused:
        unused.bind((LOOPBACK, 0))
        dead = f"http://{LOOPBACK}:{unused.getsockname()[1]}"  # bound, never listening: refused at once
        remote = open_remote("s3://bucket/run", fast_config(dead, max_attempts=2, max_retry_seconds=1.0))
        with caplog.at_level(logging.WARNING, logger="uploader.probe"):
            check_writable(remote)
    assert "could not check that s3://bucket/run is writable" in caplog.text and dead in caplog.text
    remote.close()


def test_a_probe_left_behind_is_ignored_by_listing_retention_and_pull(remote: Remote, local: Path,
                                                                      restore: Path) -> None:
    """A process killed between the check's two requests leaves its object: nothing may trip on it."""
    leftover = f"{PROBE_PREFIX}0123456789abcdef"
    remote.write_bytes(leftover, PROBE_BODY)
    for step in (1, 2):
        push(make_checkpoint(local, step), remote, keep=1)

    assert [c.step for c in list_remote(remote)] == [2] and complete_steps(remote) == [2]
    assert {o.key for o in remote.list() if checkpoint_of(o.key) is None} == {leftover, LATEST_KEY}
    pulled = pull_newest(remote, restore)
    assert pulled is not None and pulled.step == 2
