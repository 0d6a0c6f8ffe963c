"""The job's side of remote storage: pull the newest checkpoint on start-up, upload new ones.

Uploading in-process (``--upload inprocess``) is for ``docker run`` without a sidecar: a daemon thread
pushes each committed checkpoint while training goes on. With ``--upload sidecar`` the job only
writes locally and marks the folder finished; ``uploader watch`` in another container does the rest.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import Future, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

from job.exceptions import StoppedBeforeTraining
from job.logs import event
from uploader.config import UploadConfig
from uploader.exceptions import TransientStorageError
from uploader.local import LocalCheckpoint, is_node_part, list_committed
from uploader.probe import check_writable
from uploader.remote import Remote, check_url, open_remote
from uploader.runlog import RunlogMirror
from uploader.manifest import Manifest
from uploader.sync import (
    list_remote,
    list_set_aside,
    newest_complete,
    pull_files,
    pull_newest,
    set_aside_if_unchanged,
)
from uploader.worker import ABORT_GRACE, BackgroundUploader

logger = logging.getLogger(__name__)

UPLOAD_MODES = ("inprocess", "sidecar", "off")
PULL_POLL_S = 0.2  # how often a wait for a pull looks for a stop request
T = TypeVar("T")


class Pull(Generic[T]):
    """A download running in its own thread (RemoteStore.start_pull, or one of a multi-node resume's), whose
    waiter gives it up on a stop request.

    Why: a SIGTERM during a start-up download (a spot node reclaimed minutes into a large pull) was only
    answered once the pull had ended, so the job outlived its grace period and was killed. Before the first
    step nothing is trained, so nothing needs saving: the waiter stops at once (exit 75), and the store's
    close aborts the download. The checkpoint stays in the bucket for the next start."""

    def __init__(self, future: Future[T], stopped: Callable[[], str | None]) -> None:
        self._future, self._stopped = future, stopped

    def result(self) -> T:
        """What the download returned; its errors re-raised; StoppedBeforeTraining on a stop."""
        while not wait([self._future], timeout=PULL_POLL_S).done:
            why = self._stopped()
            if why is not None:
                raise StoppedBeforeTraining(
                    f"stopped ({why}) while the checkpoint to resume was downloading, before any training: nothing "
                    "new to save; the next start resumes it from the bucket")
        return self._future.result()


@dataclass(frozen=True)
class RemoteConfig:
    url: str | None
    mode: str  # one of UPLOAD_MODES
    upload: UploadConfig
    # At the end of training: how long the final checkpoint's upload may take before the job gives up
    # with exit 5, leaving the checkpoint in the local folder for the next start or a sidecar.
    final_upload_timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.mode not in UPLOAD_MODES:
            raise ValueError(f"--upload must be one of {', '.join(UPLOAD_MODES)}, not {self.mode!r}")
        if not (math.isfinite(self.final_upload_timeout) and self.final_upload_timeout > 0):
            raise ValueError(f"--final-upload-timeout must be a positive number of seconds, not {self.final_upload_timeout}")
        if self.url is not None:
            try:
                check_url(self.url)
            except ValueError as e:
                raise ValueError(f"--remote: {e}") from None


def _uploaded(ckpt: LocalCheckpoint, seconds: float) -> None:
    event(logger, "uploaded", step=ckpt.step, seconds=round(seconds, 3))


class RemoteStore:
    """One remote, opened once; owns the background uploader when uploading in-process."""

    def __init__(self, cfg: RemoteConfig, folder: Path, stopped: Callable[[], str | None] = lambda: None) -> None:
        """``stopped``: why the job is stopping (None while it is not); a wait for a pull gives up then (Pull)."""
        assert cfg.url is not None
        self.url = cfg.url
        self.final_upload_timeout = cfg.final_upload_timeout
        self._writes = cfg.mode != "off"  # --upload off: this job never changes the bucket
        self.remote: Remote = open_remote(cfg.url, cfg.upload)
        self.uploader = (BackgroundUploader(self.remote, cfg.upload.keep, runlog=RunlogMirror(folder, self.remote),
                                            on_uploaded=_uploaded) if cfg.mode == "inprocess" else None)
        self._pull: threading.Thread | None = None
        self._abort_pull = threading.Event()
        self._stopped = stopped

    def pull_if_newer(self, folder: Path, than: int | None = None) -> LocalCheckpoint | None:
        """Download the newest complete remote checkpoint when it is newer than step ``than`` (by
        default, than every committed local one).

        Raises the uploader's AuthError / BucketNotFound at once, so bad credentials fail in seconds,
        before any training.
        """
        newest = newest_complete(self.remote)
        if than is None:  # a node's part of a multi-node checkpoint is not the whole: it does not count
            local = [c for c in list_committed(folder) if not is_node_part(c)]
            than = local[-1].step if local else -1
        if newest is None or newest[0] <= than:
            return None
        return pull_newest(self.remote, folder, abort=self._abort_pull, set_aside_corrupt=self._writes, above=than)

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints under the remote prefix, oldest first (not verified)."""
        return [c.step for c in list_remote(self.remote) if c.complete]

    def holds_checkpoints(self) -> bool:
        """Whether the prefix has a run's history: complete checkpoints, or ones set aside as corrupt. Waited
        for as a Pull: a start-up's listing held by a slow remote answers a stop request at once."""
        return self._in_thread("resume-list", lambda: bool(self.complete_steps() or list_set_aside(self.remote))
                               ).result()

    def pull_step(self, folder: Path, step: int) -> LocalCheckpoint | None:
        """The whole, verified checkpoint of ``step`` in ``folder`` (downloaded unless it is there), or None.
        Waited for as a Pull: a stop request ends the wait with StoppedBeforeTraining."""
        return self._in_thread("resume-pull", lambda: pull_newest(
            self.remote, folder, abort=self._abort_pull, set_aside_corrupt=False, step=step)).result()

    def newest_complete(self, below: int | None = None) -> Manifest | None:
        """The manifest of the newest complete remote checkpoint (before step ``below``), files unchecked.
        Waited for as a Pull (a listing held by a slow remote may take the retry budget)."""
        found = self._in_thread("resume-list", lambda: newest_complete(self.remote, below)).result()
        return found[1] if found is not None else None

    def pull_files(self, manifest: Manifest, paths: Collection[str], dest: Path) -> int:
        """Only ``paths`` of the remote checkpoint ``manifest``, verified, into the new folder ``dest``;
        the bytes downloaded. CorruptCheckpoint when one differs from the manifest. Waited for as a Pull:
        a node of a multi-node resume answers a stop request at once, not when its part has downloaded.

        On a stop the download is ended before this raises, so the caller may delete ``dest``: left running,
        it went on writing there (a listing answered after the delete made the folder anew, left behind)."""
        pull = self._in_thread("resume-pull", lambda: pull_files(
            self.remote, manifest, paths, dest, abort=self._abort_pull))
        try:
            return pull.result()
        except StoppedBeforeTraining:
            self._end_pull()
            raise

    def set_aside(self, manifest: Manifest, reason: str) -> None:
        """A remote checkpoint that failed verification, out of every reader's way (uploader.sync), unless
        this job never writes to the bucket (--upload off): then it is only skipped."""
        if self._writes:
            set_aside_if_unchanged(self.remote, manifest, reason)

    def start_pull(self, folder: Path, than: int | None = None) -> Pull[LocalCheckpoint | None]:
        """:meth:`pull_if_newer` in a thread, so the download overlaps building the model; ``result()``
        re-raises its errors (AuthError, BucketNotFound) where the caller is ready for them, and gives the
        pull up on a stop request (Pull)."""
        def pull() -> LocalCheckpoint | None:
            began = time.monotonic()
            found = self.pull_if_newer(folder, than)
            if found is not None:
                event(logger, "resume_pulled", step=found.step, seconds=round(time.monotonic() - began, 3))
            return found

        return self._in_thread("resume-pull", pull)

    def _in_thread(self, name: str, download: Callable[[], T]) -> Pull[T]:
        """``download`` in a thread of its own, which close() aborts if it is still running: one at a time
        (each is waited for before the next starts, or the start-up has given up)."""
        done: Future[T] = Future()

        def run() -> None:
            try:
                done.set_result(download())
            except BaseException as e:  # noqa: BLE001 - handed over through the future
                done.set_exception(e)

        self._pull = threading.Thread(target=run, name=name, daemon=True)
        self._pull.start()
        return Pull(done, self._stopped)

    @property
    def uploads(self) -> bool:
        """Whether this job uploads its checkpoints itself (--upload inprocess)."""
        return self.uploader is not None

    def check_writable(self) -> None:
        """When this job uploads, fail now if the remote refuses writes (read-only credentials), not
        at the first upload one save interval into training (uploader.probe)."""
        if self.uploads:
            check_writable(self.remote)

    def submit(self, ckpt: LocalCheckpoint) -> None:
        if self.uploader is not None:
            self.uploader.submit(ckpt)

    def sync_runlog(self) -> None:
        """Upload the run log (ledger, curves) in the background now; with a sidecar, the sidecar does."""
        if self.uploader is not None:
            self.uploader.sync_runlog()

    def check(self) -> None:
        """Re-raise a failure that retrying cannot fix (AuthError, BucketNotFound) in the training thread,
        so a job never trains for days without a remote copy."""
        if self.uploader is not None:
            self.uploader.wait(0)

    def pending(self) -> set[Path]:
        """Local checkpoints that must not be pruned yet: queued for or under upload."""
        return self.uploader.pending_paths() if self.uploader is not None else set()

    def wait(self, timeout: float | None) -> bool:
        """Wait for the uploads submitted so far; re-raises a non-transient failure (AuthError, ...)."""
        return True if self.uploader is None else self.uploader.wait(timeout)

    def wait_final(self, step: int, folder: Path) -> None:
        """At the end of training, wait for the final checkpoint's upload, at most final_upload_timeout:
        a remote that went away must not keep a finished job (and its GPU) forever. Then it is exit 5."""
        if not self.wait(self.final_upload_timeout):
            raise TransientStorageError(
                f"the final checkpoint (step {step}) did not reach {self.url} within {self.final_upload_timeout:g} s "
                f"(--final-upload-timeout); it stays in {folder}, and the next start (or `uploader sync`) uploads it")

    def close(self, timeout: float | None = None) -> bool:
        self._end_pull()  # a start-up that failed or stopped before using its pull: stop it, leave nothing
        ok = True if self.uploader is None else self.uploader.close(timeout)
        self.remote.close()
        return ok

    def _end_pull(self) -> None:
        """Abort the download still running in its thread, and wait for it to end. Irreversible: only once
        the job has given up waiting for it (a stop, a failure, the end). Bounded: a thread held by the local
        disk (a hung volume), where no abort reaches, is left to the process's exit, which is not held up."""
        if self._pull is None or not self._pull.is_alive():
            return
        self._abort_pull.set()
        self._pull.join(ABORT_GRACE)
        if self._pull.is_alive():  # in a request the abort does not reach (a listing): cut the requests in flight
            self.remote.cancel()
            self._pull.join(ABORT_GRACE)
        if self._pull.is_alive():
            logger.warning("the start-up's download did not end %g s after it was cancelled; leaving it to the exit "
                           "(what it wrote is removed by the next start)", 2 * ABORT_GRACE)

    def describe(self, ckpt: LocalCheckpoint) -> str:
        return f"{self.url.rstrip('/')}/{ckpt.name}"
