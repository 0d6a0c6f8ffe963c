"""BackgroundUploader: pushes checkpoints from a daemon thread when the job runs without a sidecar.

The training loop must never wait on storage, so ``submit`` only records the checkpoint: if one is
still queued (not started), the newer replaces it, because only the newest matters after a
preemption. Transient storage failures are retried (the same checkpoint, unless a newer one
arrived) after ``retry_interval``; anything else (AuthError, BucketNotFound, a corrupt local
checkpoint) is kept in ``error`` and re-raised by ``wait`` so that the job fails loudly instead of
training for days without a remote copy.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from uploader.exceptions import Aborted, TransientStorageError
from uploader.local import LocalCheckpoint
from uploader.remote import Remote
from uploader.runlog import RunlogMirror
from uploader.sync import push

logger = logging.getLogger(__name__)

# After close()'s timeout: how long the thread has to stop on its own (an upload reads the abort before
# each file, part and range, and between attempts) before the requests in flight are cut (Remote.cancel).
ABORT_GRACE = 1.0
# close() with a timeout: how long the run log's last upload may take before it is cut (a silent server).
RUNLOG_GRACE = 2.0


class BackgroundUploader:
    """One daemon thread, at most one checkpoint queued behind the one uploading."""

    def __init__(self, remote: Remote, keep: int = 3, *, retry_interval: float = 5.0,
                 runlog: RunlogMirror | None = None,
                 on_uploaded: Callable[[LocalCheckpoint, float], None] | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, not {keep}")
        self._remote = remote
        self._keep = keep
        self._retry_interval = retry_interval
        self._cond = threading.Condition()
        self._queued: LocalCheckpoint | None = None
        self._current: LocalCheckpoint | None = None
        self._busy = False
        self._closing = False
        self._abort = threading.Event()
        self._error: BaseException | None = None
        self._fatal = False  # the last failure is not transient: wait() re-raises it
        self._runlog = runlog
        self._on_uploaded = on_uploaded  # (checkpoint, seconds): the job's ledger counts upload time
        self._runlog_due = False
        self._thread = threading.Thread(target=self._run, name="uploader-background", daemon=True)
        self._thread.start()

    @property
    def error(self) -> BaseException | None:
        """The exception of the last failed upload; None once an upload succeeds."""
        with self._cond:
            return self._error

    def pending_paths(self) -> set[Path]:
        """Folders of the checkpoints queued or uploading: pass them to uploader.local.prune(protect=...)
        so that local retention never deletes a checkpoint under its upload."""
        with self._cond:
            return {c.path for c in (self._current, self._queued) if c is not None}

    def submit(self, ckpt: LocalCheckpoint) -> None:
        """Queue ``ckpt`` for upload and return at once; replaces a queued, not yet started one."""
        with self._cond:
            if self._closing:
                raise RuntimeError("BackgroundUploader is closed")
            if self._queued is not None:
                logger.info("%s superseded by %s before its upload started", self._queued.name, ckpt.name)
            self._queued = ckpt
            self._cond.notify_all()

    def sync_runlog(self) -> None:
        """Upload the run log (uploader.runlog) soon, from the background thread; it also goes up after
        every checkpoint and at close."""
        with self._cond:
            self._runlog_due = True
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """True once everything submitted is uploaded; False if ``timeout`` passes first.

        Re-raises the last error when it is not transient (AuthError, BucketNotFound, ...): waiting
        longer would not help.
        """
        with self._cond:
            idle = self._cond.wait_for(
                lambda: self._fatal or (self._queued is None and not self._busy and self._error is None)
                or not self._thread.is_alive(),
                timeout,
            )
            if self._fatal and self._error is not None:
                raise self._error
            return bool(idle) and self._queued is None and not self._busy and self._error is None

    def close(self, timeout: float | None = None) -> bool:
        """Stop accepting work, let the queued upload finish for up to ``timeout`` seconds, stop the thread.

        Returns whether everything submitted was uploaded. An upload still running when the
        timeout ends is aborted (the remote keeps its previous complete checkpoint).
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        cancelled = False
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._abort.set()
            with self._cond:
                self._cond.notify_all()
            # An idle thread, or an upload between two requests, stops at once; a request hanging on a silent
            # server is cut, not left to its retry budget. Not before: the run log still goes up (below).
            self._thread.join(ABORT_GRACE)
            if self._thread.is_alive():
                self._remote.cancel()
                cancelled = True
                self._thread.join()
        # The last records (a life's end) after the last checkpoint: a few KiB, and the checkpoints came first.
        # Only while the storage works: after a failed or aborted upload, one more operation could only
        # spend its whole retry budget on the way out (the next life uploads the records).
        if self._error is None and not cancelled:  # (a cancelled remote refuses every request)
            if timeout is None:
                self._mirror_runlog()
            else:  # a job with no time left: a silent server's request is cut after a short grace
                timer = threading.Timer(RUNLOG_GRACE, self._remote.cancel)
                timer.start()
                try:
                    self._mirror_runlog()
                finally:
                    timer.cancel()
        with self._cond:
            return self._queued is None and self._error is None

    def __enter__(self) -> BackgroundUploader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued is not None or self._closing or self._runlog_due)
                ckpt = self._queued
                runlog_only = ckpt is None and self._runlog_due and not self._closing
                self._runlog_due = False
                if ckpt is None and not runlog_only:  # closing with nothing queued
                    return
                if ckpt is not None:
                    self._queued = None
                    self._current = ckpt
                    self._busy = True
            if ckpt is None:  # only the run log asked for (sync_runlog)
                self._mirror_runlog()
                continue
            began = time.monotonic()
            try:
                push(ckpt, self._remote, self._keep, abort=self._abort)
            except Aborted as e:
                self._finish(e, fatal=False)
                return
            except TransientStorageError as e:
                logger.warning("upload of %s failed: %s; retrying in %.0f s", ckpt.name, e, self._retry_interval)
                self._finish(e, fatal=False, retry=ckpt)
                continue
            except Exception as e:  # noqa: BLE001 - reported to the job through wait()/error
                logger.error("upload of %s failed: %s", ckpt.name, e)
                self._finish(e, fatal=True)
                continue
            if self._on_uploaded is not None:
                self._on_uploaded(ckpt, time.monotonic() - began)
            self._mirror_runlog()
            self._finish(None, fatal=False)

    def _mirror_runlog(self) -> None:
        if self._runlog is not None:
            self._runlog.sync_or_warn()

    def _finish(self, error: BaseException | None, *, fatal: bool, retry: LocalCheckpoint | None = None) -> None:
        with self._cond:
            self._busy = False
            self._current = retry  # still in use while it waits for its retry
            self._error = error
            self._fatal = fatal
            if retry is not None and self._queued is None:
                # Wait before retrying, unless a newer checkpoint or close() arrives meanwhile.
                self._cond.wait_for(lambda: self._queued is not None or self._closing or self._abort.is_set(),
                                    self._retry_interval)
                if self._queued is None and not self._abort.is_set():
                    self._queued = retry
            self._current = None
            self._cond.notify_all()
