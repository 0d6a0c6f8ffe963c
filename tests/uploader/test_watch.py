"""The sidecar loop, in-process and as the ``uploader watch`` process a pod runs."""
from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.checkpoints import WITH_LARGE_FILE, complete_steps, data_files_of, make_checkpoint
from tests.support.faultproxy import FaultProxy
from tests.support.polling import wait_until
from tests.support.s3server import READER, Bucket, SeaweedFS, fast_config
from tests.support.uploader_cli import cli_env, run_cli, uploader_command
from uploader.config import UploadConfig
from uploader.exceptions import Aborted, CorruptCheckpoint, TransientStorageError
from uploader.layout import data_key, manifest_key
from uploader.local import checkpoint_name, finished_marker, list_committed, list_set_aside, mark_finished
from uploader.manifest import MANIFEST_NAME
from uploader.remote import Remote, open_remote
from uploader.sync import pull_newest, push
from uploader import watch as watch_module
from uploader.watch import WatchOutcome, watch

POLL = 0.05
Running = tuple[Future[WatchOutcome], threading.Event]  # watch()'s outcome to come, and its stop event
StartWatch = Callable[..., Running]


@pytest.fixture
def run_watch() -> Iterator[StartWatch]:
    """Start watch() in a thread: returns (its future outcome, its stop event); stopped at teardown."""
    pool = ThreadPoolExecutor(max_workers=1)
    stops: list[threading.Event] = []

    def start(folder: Path, remote: Remote, config: UploadConfig, **kwargs: float) -> Running:
        stop = threading.Event()
        stops.append(stop)
        return pool.submit(watch, folder, remote, config, stop, poll_interval=POLL, **kwargs), stop

    yield start
    for stop in stops:
        stop.set()
    pool.shutdown(wait=True)


def test_watch_uploads_the_newest_and_ends_once_the_job_finished(
    run_watch: StartWatch, tmp_path: Path, local: Path
) -> None:
    remote = open_remote(f"file://{tmp_path / 'remote'}", fast_config())
    make_checkpoint(local, 1)
    outcome, _ = run_watch(local, remote, fast_config())
    wait_until(lambda: complete_steps(remote) == [1], what="step 1 uploaded")

    for step in (2, 3, 4):
        make_checkpoint(local, step)
    mark_finished(local, 4)

    assert outcome.result(timeout=30) is WatchOutcome.FINISHED
    assert complete_steps(remote)[-1] == 4


@pytest.mark.s3
@pytest.mark.parametrize("ending", ["finished", "sigterm-then-final-checkpoint", "sigterm-job-gone"])
def test_watch_process_uploads_what_is_committed_then_exits_0(
    s3_bucket: Bucket, tmp_path: Path, local: Path, ending: str
) -> None:
    """Each way a sidecar ends: the job finished; SIGTERM reached both at once, so the job's final
    checkpoint is committed after the watch's SIGTERM; SIGTERM and the job never says it ended
    (killed): the watch uploads what is committed and leaves when its grace runs out."""
    remote = open_remote(s3_bucket.url(), fast_config(s3_bucket.endpoint_url))
    make_checkpoint(local, 1)
    proc = subprocess.Popen(uploader_command("watch", str(local), s3_bucket.url(), "--poll-interval", "0.1",
                                             "--grace", "3"),
                            env=cli_env(s3_bucket), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: complete_steps(remote) == [1], what="step 1 uploaded")
        if ending == "finished":
            make_checkpoint(local, 2)  # committed just before the end: it must still go up
            mark_finished(local, 2)
        elif ending == "sigterm-then-final-checkpoint":
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # the job is still finishing its step
            make_checkpoint(local, 2)
            mark_finished(local, 2, reason="preempted")
        else:
            make_checkpoint(local, 2)
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()

    assert proc.returncode == 0, stderr
    assert complete_steps(remote) == [1, 2]


@pytest.mark.s3
def test_a_sidecar_with_read_only_credentials_exits_3_before_the_first_checkpoint(s3_bucket: Bucket, local: Path) -> None:
    """Before the write check it waited, for as long as the job took to commit one, and only then failed."""
    result = run_cli(["watch", str(local), s3_bucket.url()], cli_env(s3_bucket, READER), timeout=30)

    lines = result.stderr.strip().splitlines()
    assert result.returncode == 3, result.stderr
    assert lines[-1].startswith(f"uploader: error: {s3_bucket.url()} is not writable (start-up write check)")
    assert "AccessDenied" in lines[-1] and s3_bucket.endpoint_url in lines[-1]
    assert "Traceback" not in result.stderr and READER.secret_key not in result.stderr


def test_a_finished_marker_left_by_an_earlier_run_does_not_end_the_watch(
    run_watch: StartWatch, tmp_path: Path, local: Path
) -> None:
    remote = open_remote(f"file://{tmp_path / 'remote'}", fast_config())
    make_checkpoint(local, 1)
    mark_finished(local, 1)  # the previous run's, on a persistent volume
    time.sleep(0.05)
    outcome, _ = run_watch(local, remote, fast_config())
    wait_until(lambda: complete_steps(remote) == [1], what="step 1 uploaded")
    time.sleep(0.5)
    assert not outcome.done()  # a new run is about to start on this folder: keep watching
    make_checkpoint(local, 2)
    mark_finished(local, 2)
    assert outcome.result(timeout=30) is WatchOutcome.FINISHED
    assert complete_steps(remote) == [1, 2]


def test_a_remote_entry_that_is_not_an_object_ends_the_watch_and_sets_nothing_aside(
    run_watch: StartWatch, tmp_path: Path, local: Path
) -> None:
    """Review B, 01: a folder where the remote manifest goes made the sidecar set the good local checkpoint
    aside. It is the remote's damage, which no retry fixes: the watch ends with it (exit 6), local untouched."""
    root = tmp_path / "remote"
    ckpt = make_checkpoint(local, 4)
    (root / ckpt.name / MANIFEST_NAME).mkdir(parents=True)
    outcome, _ = run_watch(local, open_remote(f"file://{root}", fast_config()), fast_config(), grace=1)

    with pytest.raises(CorruptCheckpoint, match=f"cannot upload {ckpt.name} .* is not a regular file"):
        outcome.result(timeout=10)
    assert list_committed(local) == [ckpt] and list_set_aside(local) == []


@pytest.mark.s3
def test_watch_catches_up_after_the_server_was_stopped_mid_upload(
    run_watch: StartWatch, restartable_s3: SeaweedFS, aws_env: object, tmp_path: Path, local: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = restartable_s3
    bucket = Bucket(server.create_bucket(), server.endpoint_url)
    proxy = FaultProxy(server.ports["s3.port"])
    config = fast_config(proxy.endpoint_url, max_attempts=3, max_retry_seconds=3.0)
    remote = open_remote(bucket.url(), config)
    make_checkpoint(local, 1)
    outcome, _ = run_watch(local, remote, config)
    wait_until(lambda: complete_steps(remote) == [1], what="step 1 uploaded")

    proxy.delay(0.02)  # slow enough to stop the server while the large file is in flight
    big = make_checkpoint(local, 2, WITH_LARGE_FILE)
    wait_until(lambda: any(f"{big.name}/big.bin" in line for line in proxy.counters.request_lines),
               what="the large file's upload to start")
    with caplog.at_level(logging.ERROR, logger="uploader.watch"):
        server.stop()
        wait_until(lambda: f"trying {big.name} again" in caplog.text, what="the upload to give up once")
    proxy.passthrough()
    server.start()

    wait_until(lambda: complete_steps(remote) == [1, 2], timeout=60, what="step 2 uploaded after the restart")
    mark_finished(local, 2)
    assert outcome.result(timeout=30) is WatchOutcome.FINISHED
    pulled = pull_newest(remote, tmp_path / "restore")
    assert pulled is not None and data_files_of(pulled.path) == data_files_of(big.path)
    proxy.close()


@pytest.mark.s3
def test_watch_aborts_the_upload_when_the_grace_period_runs_out(
    fault_proxy: FaultProxy, s3_bucket: Bucket, local: Path
) -> None:
    config = fast_config(fault_proxy.endpoint_url)
    remote = open_remote(s3_bucket.url(), config)
    make_checkpoint(local, 1)
    stop = threading.Event()
    stop.set()  # SIGTERM already arrived: upload what is committed, within the grace period
    mark_finished(local, 1)
    assert watch(local, remote, config, stop, poll_interval=POLL, grace=30) is WatchOutcome.FINISHED

    fault_proxy.delay(0.02)  # the large file now needs seconds; the grace period is half a second
    make_checkpoint(local, 2, WITH_LARGE_FILE)
    with pytest.raises(Aborted, match="grace period"):
        watch(local, remote, config, stop, poll_interval=POLL, grace=0.5)

    fault_proxy.passthrough()
    assert complete_steps(remote) == [1]
    assert remote.head(data_key(checkpoint_name(2), "big.bin")) is None  # its multipart upload was aborted


def test_a_run_resumed_from_an_older_step_is_uploaded_before_the_watch_says_so(
    run_watch: StartWatch, tmp_path: Path, local: Path
) -> None:
    """Review B, R2: the README's recovery of a diverged run (step 300 moved out of the folder and the remote,
    the next life resumes at 200) under a long-lived sidecar. It never uploaded a step below the highest it had
    uploaded, then said the final step 250 was uploaded and exited 0: the bucket had only 100 and 200."""
    root = tmp_path / "remote"
    remote = open_remote(f"file://{root}", fast_config())
    outcome, _ = run_watch(local, remote, fast_config())
    for step in (100, 200, 300):
        make_checkpoint(local, step)
        wait_until(lambda: step in complete_steps(remote), what=f"step {step} uploaded")
    name = checkpoint_name(300)
    (local / name).rename(tmp_path / name)
    shutil.rmtree(root / name)

    make_checkpoint(local, 250, seed=2501)
    mark_finished(local, 250, reason="preempted")

    assert outcome.result(timeout=30) is WatchOutcome.FINISHED
    assert complete_steps(remote) == [100, 200, 250]


def test_the_watch_uploads_the_older_checkpoints_of_its_keep_window_too(
    run_watch: StartWatch, tmp_path: Path, local: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Checkpoints committed while the watch was busy (or before it started) go up after the newest, as `sync`
    uploads the newest `keep`: they were skipped, and a resume whose newest failed had nothing older remotely."""
    remote = open_remote(f"file://{tmp_path / 'remote'}", fast_config())
    for step in (1, 2, 3, 4):
        make_checkpoint(local, step)
    with caplog.at_level(logging.INFO):
        outcome, _ = run_watch(local, remote, fast_config(keep=3))
        wait_until(lambda: complete_steps(remote) == [2, 3, 4], what="the keep window uploaded")
        mark_finished(local, 4)
        assert outcome.result(timeout=30) is WatchOutcome.FINISHED

    assert "newer than the checkpoint just uploaded" not in caplog.text  # retention counts back from 4


@pytest.mark.parametrize("ending", ["stopped", "finished"])
def test_once_stopped_or_finished_the_watch_uploads_the_newest_and_final_only(
    run_watch: StartWatch, tmp_path: Path, local: Path, ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 38: after SIGTERM the watch caught up on the keep window's older checkpoints first, and on a slow
    link its grace ran out on one of them (exit 5, an aborted upload left) after the final one was up."""
    remote = open_remote(f"file://{tmp_path / 'remote'}", fast_config())
    for step in (1, 2, 3):
        make_checkpoint(local, step)
    uploading, first_upload = threading.Event(), threading.Event()  # held, as on a slow link, until the end
    real_push = watch_module.push

    def slow_push(*args: Any, **kwargs: Any) -> None:
        uploading.set()
        assert first_upload.wait(30)
        real_push(*args, **kwargs)

    monkeypatch.setattr(watch_module, "push", slow_push)
    outcome, stop = run_watch(local, remote, fast_config(keep=3))
    assert uploading.wait(30)  # step 3, the newest: the job's end below comes after the watch started
    if ending == "stopped":
        stop.set()
    make_checkpoint(local, 4)
    mark_finished(local, 4)
    first_upload.set()
    assert outcome.result(timeout=30) is WatchOutcome.FINISHED
    assert 4 in complete_steps(remote) and set(complete_steps(remote)) <= {3, 4}  # never 1 or 2


def test_a_job_that_ends_while_the_watch_checks_its_write_access_ends_the_watch(
    run_watch: StartWatch, tmp_path: Path, local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 39: the write check may ride out an outage for its whole retry budget; a job that ended
    meanwhile left a marker older than the watch's start, taken for an earlier run's: it never exited."""
    remote = open_remote(f"file://{tmp_path / 'remote'}", fast_config())

    def job_ends_meanwhile(remote: Remote) -> None:
        make_checkpoint(local, 1)
        mark_finished(local, 1, reason="failed")

    monkeypatch.setattr(watch_module, "check_writable", job_ends_meanwhile)
    outcome, _ = run_watch(local, remote, fast_config())
    assert outcome.result(timeout=10) is WatchOutcome.FINISHED and complete_steps(remote) == [1]


def test_a_final_step_saved_again_after_the_pass_is_uploaded_before_the_watch_ends(
    run_watch: StartWatch, tmp_path: Path, local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 39: a run rolled back re-saves step 500, whose diverged save is complete in the bucket. Saved
    and marked right after a pass found nothing to do, the bucket's old 500 ended the watch: never uploaded."""
    remote = open_remote(f"file://{tmp_path / 'remote'}", fast_config())
    make_checkpoint(local, 400)
    diverged = make_checkpoint(local, 500, seed=1)
    push(list_committed(local)[0], remote, keep=3)
    push(diverged, remote, keep=3)
    shutil.rmtree(diverged.path)  # the rollback: the run restarts from 400
    real_pending, saved = watch_module._pending, threading.Event()

    def pending(*args: Any, **kwargs: Any) -> Any:
        found = real_pending(*args, **kwargs)
        if found is None and not saved.is_set():
            saved.set()  # the job's final save of 500 and its marker, between the pass and the end check
            make_checkpoint(local, 500, seed=2)
            mark_finished(local, 500)
        return found

    monkeypatch.setattr(watch_module, "_pending", pending)
    outcome, _ = run_watch(local, remote, fast_config())
    assert outcome.result(timeout=30) is WatchOutcome.FINISHED
    saved_now = (local / checkpoint_name(500) / MANIFEST_NAME).read_bytes()
    assert remote.read_bytes(manifest_key(checkpoint_name(500))) == saved_now


def test_a_job_that_ended_with_no_checkpoint_ends_the_watch_whatever_the_storage_says(
    tmp_path: Path, local: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 39: with nothing committed, the end check asked the remote first; an outage there ended the
    watch with exit 5 instead of its "no checkpoint to upload"."""
    def outage(remote: Remote, step: int) -> bool:
        raise TransientStorageError("GET: 503 after 5 tries")

    monkeypatch.setattr(watch_module, "is_complete", outage)
    local.mkdir(parents=True, exist_ok=True)
    mark_finished(local, 0, reason="failed")
    marker = finished_marker(local)
    assert marker is not None
    remote = open_remote(f"file://{tmp_path / 'remote'}", fast_config())
    assert watch_module._ended(local, marker, set(), set(), remote)


def test_while_only_older_parts_wait_the_steps_other_nodes_started_are_listed_every_30_s_at_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older part waits for another node to start its step: each poll (2 s) once listed the whole prefix."""
    listings: list[float] = []
    monkeypatch.setattr(watch_module, "steps_other_nodes_started", lambda remote: listings.append(0) or {7})
    started = watch_module.StartedSteps(open_remote(f"file://{tmp_path / 'remote'}", fast_config()))
    assert started.get(fresh=False) == {7} and started.get(fresh=False) == {7} and len(listings) == 1
    assert started.get(fresh=True) == {7} and len(listings) == 2  # the newest part's choice: listed again
    started._at -= watch_module.STARTED_REFRESH_S  # as if its listing were that old
    started.get(fresh=False)
    assert len(listings) == 3
