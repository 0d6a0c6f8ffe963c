"""BackgroundUploader: what the job uses when no sidecar runs."""
from __future__ import annotations

import threading
import uuid
from pathlib import Path

import pytest

from tests.support.checkpoints import SMALL_FILES, complete_steps, make_checkpoint
from tests.support.faultproxy import FaultProxy
from tests.support.polling import outcome_within, wait_until
from tests.support.recording import RecordingRemote
from tests.support.s3server import Bucket, fast_config
from uploader.config import MiB
from uploader.exceptions import AuthError, BucketNotFound, StorageError, TransientStorageError
from uploader.remote import open_remote
from uploader.runlog import RunlogMirror
from uploader.worker import BackgroundUploader


def test_a_queued_checkpoint_is_replaced_by_a_newer_one(tmp_path: Path, local: Path) -> None:
    gate = threading.Event()
    remote = RecordingRemote(open_remote(f"file://{tmp_path / 'remote'}", fast_config()), gate=gate)
    uploader = BackgroundUploader(remote, keep=5)
    first = make_checkpoint(local, 1)
    uploader.submit(first)
    assert remote.blocked.wait(10)  # step 1 is uploading (held at the gate)

    uploader.submit(make_checkpoint(local, 2))  # queued...
    third = make_checkpoint(local, 3)
    uploader.submit(third)  # ...and replaced before it started
    assert uploader.pending_paths() == {first.path, third.path}  # what local pruning must spare
    gate.set()

    assert uploader.wait(30) is True
    assert uploader.error is None
    assert complete_steps(remote.inner) == [1, 3]
    assert uploader.pending_paths() == set()
    assert uploader.close() is True


@pytest.mark.s3
@pytest.mark.parametrize(
    ("bucket_name", "secret", "error"),
    [(f"missing-{uuid.uuid4().hex[:8]}", None, BucketNotFound), (None, "wrong-secret", AuthError)],
    ids=["missing-bucket", "wrong-secret"],
)
def test_wait_reraises_a_permanent_error(s3_bucket: Bucket, local: Path, monkeypatch: pytest.MonkeyPatch,
                                         bucket_name: str | None, secret: str | None,
                                         error: type[StorageError]) -> None:
    if secret is not None:
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    url = f"s3://{bucket_name or s3_bucket.name}/ckpt"
    uploader = BackgroundUploader(open_remote(url, fast_config(s3_bucket.endpoint_url)), keep=3)
    uploader.submit(make_checkpoint(local, 1))

    with pytest.raises(error):
        uploader.wait(30)
    assert isinstance(uploader.error, error)
    assert uploader.close(timeout=10) is False


@pytest.mark.s3
def test_wait_is_false_while_storage_is_down_and_true_once_it_is_back(
    fault_proxy: FaultProxy, s3_bucket: Bucket, local: Path
) -> None:
    remote = open_remote(s3_bucket.url(), fast_config(fault_proxy.endpoint_url, max_attempts=2, max_retry_seconds=2))
    fault_proxy.reset_after(0)  # every connection dies at its first byte
    uploader = BackgroundUploader(remote, keep=3, retry_interval=0.2)
    uploader.submit(make_checkpoint(local, 1))

    wait_until(lambda: isinstance(uploader.error, TransientStorageError), what="the first give-up")
    assert uploader.wait(0.5) is False
    fault_proxy.passthrough()

    assert uploader.wait(30) is True
    assert uploader.error is None and complete_steps(remote) == [1]
    assert uploader.close() is True


@pytest.mark.s3
@pytest.mark.parametrize(("files", "held"), [
    (SMALL_FILES, "/step-"),  # every request about the checkpoint
    ({"state.pt": 12 * MiB}, "uploadId="),  # the parts, and the multipart upload's abort after the cut
], ids=["single", "multipart"])
def test_closing_after_its_timeout_cuts_a_request_the_server_never_answers(
    fault_proxy: FaultProxy, s3_bucket: Bucket, local: Path, files: dict[str, int], held: str
) -> None:
    """A job that gave up on its final upload (--final-upload-timeout) closes its uploader: a request the
    server holds without an answer kept it (and the job, and its GPU) for the rest of the retry budget,
    two minutes by default; an hour here. Under torchrun the launcher then killed the rank with the exit
    code to give."""
    remote = RecordingRemote(open_remote(s3_bucket.url(), fast_config(fault_proxy.endpoint_url,
                                                                      max_retry_seconds=3600.0, read_timeout=3600.0)))
    fault_proxy.hold(held)  # those requests wait in the proxy
    uploader = BackgroundUploader(remote, keep=3)
    uploader.submit(make_checkpoint(local, 1, files))
    wait_until(lambda: fault_proxy.counters.held > 0, what="the upload's first request held")

    closed: list[bool] = []
    assert outcome_within(30, lambda: closed.append(uploader.close(timeout=0.5))) is None

    assert closed == [False] and remote.ops("cancel") == [None]
    fault_proxy.passthrough()
    assert complete_steps(open_remote(s3_bucket.url(), fast_config(s3_bucket.endpoint_url))) == []


@pytest.mark.s3
@pytest.mark.parametrize("silent", [False, True], ids=["storage-works", "storage-went-silent"])
def test_an_idle_uploader_closed_at_once_still_uploads_the_run_log_if_it_can(
    fault_proxy: FaultProxy, s3_bucket: Bucket, local: Path, silent: bool
) -> None:
    """A preempted or failed job closes its uploader with no time to wait (timeout 0); the life's last
    record, written just before, must still go up: the next life and `job report` read it there. Once
    cancelled at once, it stayed local. A server gone silent meanwhile must not hold the job for the retry
    budget (an hour here) past its grace period: the record's upload is cut after a short grace."""
    remote = RecordingRemote(open_remote(s3_bucket.url(), fast_config(fault_proxy.endpoint_url,
                                                                      max_retry_seconds=3600.0, read_timeout=3600.0)))
    record = local / "runlog" / "ledger" / "life-1.json"
    record.parent.mkdir(parents=True)
    record.write_text('{"end": null}')
    uploader = BackgroundUploader(remote, keep=3, runlog=RunlogMirror(local, remote))
    uploader.submit(make_checkpoint(local, 1))
    assert uploader.wait(30) is True
    record.write_text('{"end": "preempted"}')  # the ledger's final record
    if silent:
        fault_proxy.hold("/runlog/")

    assert outcome_within(30, lambda: uploader.close(timeout=0)) is None

    uploaded = open_remote(s3_bucket.url(), fast_config(s3_bucket.endpoint_url)).read_bytes("runlog/ledger/life-1.json")
    assert uploaded == (b'{"end": null}' if silent else b'{"end": "preempted"}')  # (before the proxy lets it go)
    assert remote.ops("cancel") == ([None] if silent else [])
