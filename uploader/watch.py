"""The sidecar loop: upload each newly committed checkpoint, newest first, until told to stop.

Only the newest committed checkpoint matters after a preemption, so the newest goes up first; while the
job runs, the older ones of the keep window (the newest ``keep`` committed ones, as ``sync``) that are not
complete in the remote go up after it, whatever this watch uploaded before (a run resumed from an older
step after its newer ones were moved away is uploaded too), each counting retention back from the newest
uploaded. Once the job has ended or the watch is stopping, only its final checkpoint and the newest do
(_pending).
Each local checkpoint is looked at once per save (its manifest's identity): one already complete in the
remote costs one read of its manifest. Storage outages are ridden out: an upload that gives
up (TransientStorageError) is tried again on the next poll and resumes where it stopped. Wrong
credentials or a missing bucket end the loop at once (they will not fix themselves); credentials
that may read but not write are found before the first checkpoint, by uploader.probe. So does a
remote step that an upload must not replace (a newer build's, or an entry that is not an object:
uploader.sync), exit 6: the local checkpoint is left as it is. Only a local checkpoint that fails its
own checks (LocalCheckpointError) is set aside, and the watch goes on with the next one.

It ends by itself, FINISHED, once the job has marked the folder finished (uploader.local.mark_finished)
after this watch started, and that step is uploaded: this watch uploaded (or found in the remote) that
exact local checkpoint or, where no local checkpoint of that step verifies, the remote holds it complete
(_ended). A job whose marker names a step it has no checkpoint of, locally or remotely, ends the watch
with a warning once its newest is uploaded.
A marker older than the watch is left over from
an earlier run on the same volume (a PVC, a compose volume): the job clears it when it starts, so it
is not a reason to stop.

When ``stop`` is set (SIGTERM in the CLI) the job may still be writing its final checkpoint: when
both get SIGTERM at once (docker compose, clusters without native sidecars) the job needs a few
seconds to finish its step and commit. So the watch keeps going until the job's marker is there
(of any age: by then the job has ended) and everything committed is uploaded, or until ``grace``
runs out; with Kubernetes native sidecars the job has already exited and this takes one upload. An
upload still in flight when the grace ends is aborted and Aborted is raised, leaving the remote at
its previous complete checkpoint.
"""
from __future__ import annotations

import enum
import logging
import math
import threading
import time
from pathlib import Path

from uploader.config import UploadConfig
from uploader.exceptions import Aborted, LocalCheckpointError, StorageError, TransientStorageError
from uploader.local import Finished, LocalCheckpoint, finished_marker, is_node_part, list_committed
from uploader.manifest import MANIFEST_NAME
from uploader.probe import check_writable
from uploader.remote import Remote
from uploader.runlog import RunlogMirror
from uploader.sync import is_complete, push, set_aside_local, steps_other_nodes_started

logger = logging.getLogger(__name__)

Identity = tuple[int, int, int]  # (step, manifest inode, manifest mtime): one save of a local checkpoint
# While only older node parts wait (the newest is up), which steps other nodes started is listed at most this
# often: a listing of the whole prefix at every poll, for as long as a skipped part stays on disk, is waste.
STARTED_REFRESH_S = 30.0


class StartedSteps:
    """sync.steps_other_nodes_started, listed again when a choice involves the newest part, or when the last
    listing is older than STARTED_REFRESH_S."""

    def __init__(self, remote: Remote) -> None:
        self._remote = remote
        self._steps: set[int] = set()
        self._at = -math.inf

    def get(self, fresh: bool) -> set[int]:
        if fresh or time.monotonic() - self._at >= STARTED_REFRESH_S:
            self._steps = steps_other_nodes_started(self._remote)
            self._at = time.monotonic()
        return self._steps


class WatchOutcome(enum.Enum):
    FINISHED = "finished"  # the job is done and its last checkpoint is uploaded
    STOPPED = "stopped"  # stop was requested and everything committed is uploaded


def watch(
    folder: Path,
    remote: Remote,
    config: UploadConfig,
    stop: threading.Event,
    *,
    poll_interval: float = 2.0,
    grace: float = 90.0,
) -> WatchOutcome:
    """Run until FINISHED or stopped (see the module docstring); ``stop`` may be set from any thread."""
    if poll_interval <= 0 or grace < 0:
        raise ValueError("poll_interval must be > 0 and grace >= 0")
    abort = threading.Event()
    returned = threading.Event()
    timer = threading.Thread(target=_grace_timer, args=(stop, abort, returned, grace), name="uploader-grace",
                             daemon=True)
    timer.start()
    logger.info("watching %s, uploading to %s (keep %d)", folder, remote.url, config.keep)
    started = time.time()  # before the write check, which may ride out an outage while the job ends
    try:
        check_writable(remote)  # read-only credentials end the watch now, not at the first checkpoint
        return _loop(folder, remote, config.keep, stop, abort, poll_interval, grace, started)
    finally:
        returned.set()
        timer.join()


def _grace_timer(stop: threading.Event, abort: threading.Event, returned: threading.Event, grace: float) -> None:
    """Once ``stop`` is set, allow ``grace`` seconds, then abort whatever upload is in flight."""
    while not stop.wait(0.1):
        if returned.is_set():
            return
    if not returned.wait(grace):
        abort.set()


def _loop(
    folder: Path,
    remote: Remote,
    keep: int,
    stop: threading.Event,
    abort: threading.Event,
    poll_interval: float,
    grace: float,
    started: float,
) -> WatchOutcome:
    runlog = RunlogMirror(folder, remote)  # the ledger and curves, after each checkpoint and at the end
    done: set[Identity] = set()  # local checkpoints complete in the remote: pushed, or found there, by this watch
    given_up: set[Identity] = set()  # local checkpoints that do not verify: not retried
    started_steps = StartedSteps(remote)
    announced_stop = False
    while True:
        if stop.is_set() and not announced_stop:
            announced_stop = True
            logger.info("stop requested: uploading what is committed (at most %.0f s more)", grace)
        pending = _pending(folder, keep, done, given_up, remote, stopping=stop.is_set(), started_steps=started_steps)
        if pending is not None:
            ckpt, identity, anchor = pending
            try:
                push(ckpt, remote, keep, abort=abort, anchor=anchor)
            except LocalCheckpointError as e:
                set_aside_local(ckpt, e)  # never uploaded, counted or chosen again
                given_up.add(identity)
                continue
            except TransientStorageError as e:
                logger.error("%s; trying %s again in %.0f s", e, ckpt.name, poll_interval)
                abort.wait(poll_interval)
                continue
            except Aborted:
                raise Aborted(
                    f"the grace period of {grace:.0f} s ran out before {ckpt.name} was uploaded to "
                    f"{remote.url}; the remote keeps its previous complete checkpoint"
                ) from None
            done.add(identity)
            runlog.sync_or_warn()
            continue  # look again at once: a newer checkpoint may have been committed meanwhile
        marker = finished_marker(folder)
        if marker is not None and (stop.is_set() or marker.mtime >= started) and _ended(folder, marker, done, given_up,
                                                                                        remote):
            runlog.sync_or_warn()
            return WatchOutcome.FINISHED
        if stop.is_set() and abort.is_set():
            logger.warning("the grace period ended before the job marked %s finished; its newest checkpoint "
                           "is uploaded; exiting", folder)
            runlog.sync_or_warn()
            return WatchOutcome.STOPPED
        (abort if stop.is_set() else stop).wait(poll_interval)


def _identity(ckpt: LocalCheckpoint) -> Identity | None:
    """(step, manifest inode, manifest mtime): a re-save of the same step (after a resume) counts as new.
    None when the checkpoint was pruned by the job since the listing."""
    try:
        st = (ckpt.path / MANIFEST_NAME).stat()
    except FileNotFoundError:
        return None
    return ckpt.step, st.st_ino, st.st_mtime_ns


def _ended(folder: Path, marker: Finished, done: set[Identity], given_up: set[Identity], remote: Remote) -> bool:
    """Whether the job's final checkpoint (the marker's step) is uploaded, said in one line when it is. Asked
    once nothing is pending: a local checkpoint of that step is uploaded when this watch pushed (or found)
    that exact save; one it has not is a save that came after the pass (a re-save of the step: the next pass
    uploads it), so the remote's copy of the step, maybe the old save, does not count for it. Only where the
    step has no local checkpoint that verifies does the remote's complete one count. A step with no
    checkpoint anywhere ends the watch with a warning, since nothing is left to wait for."""
    committed = list_committed(folder)
    if not committed:
        logger.info("the job ended (%s) at step %d with no checkpoint to upload; exiting", marker.reason, marker.step)
        return True
    local = next((c for c in committed if c.step == marker.step), None)
    identity = _identity(local) if local is not None else None
    if identity is not None and identity in done:
        logger.info("the job ended (%s) at step %d and it is uploaded; exiting", marker.reason, marker.step)
        return True
    if identity is not None and identity not in given_up:
        return False
    try:
        there = is_complete(remote, marker.step)
    except TransientStorageError as e:  # asked again at the next poll, as an upload that failed would be
        logger.info("cannot see whether step %d is complete on %s (%s); asking again", marker.step, remote.url, e)
        return False
    if there:
        logger.info("the job ended (%s) at step %d and it is complete on %s; exiting", marker.reason, marker.step,
                    remote.url)
    else:
        logger.warning("the job ended (%s) at step %d, but no checkpoint of that step that verifies is in %s or "
                       "on %s; its newest is uploaded; exiting", marker.reason, marker.step, folder, remote.url)
    return True


def _pending(
    folder: Path, keep: int, done: set[Identity], given_up: set[Identity], remote: Remote, stopping: bool = False,
    started_steps: StartedSteps | None = None,
) -> tuple[LocalCheckpoint, Identity, int | None] | None:
    """The next committed checkpoint to upload, its identity, and the step retention counts back from (the
    newest of the window this watch has made complete, None for itself).

    The newest goes first, then the older ones of the keep window (the newest ``keep`` committed ones) that
    this watch has not pushed or found complete remotely: what was uploaded before does not matter, so a run
    resumed from an older step (its newer checkpoints moved away) is uploaded too. Older ones only while the
    job runs: once it has ended, or the watch is ``stopping`` (SIGTERM), only the job's final checkpoint
    (first) and the newest go up, or an old one would take the grace the final one needs. A node's older part
    goes up only where another node has started that step (below): one the other nodes skipped would never
    complete.

    A node's part of a multi-node checkpoint is whole only once every node has uploaded its part of that
    step, and the sidecars never talk to each other: where another node has uploaded a newer step than
    this one did, and this node has it too, that one goes up instead of the newest, so that a node whose
    link is slower than the saves completes a checkpoint with each upload (the job's own uploads agree
    on the steps instead, job.checkpoint). Once the job has ended, its final checkpoint goes first.
    """
    committed = list_committed(folder)
    marker = finished_marker(folder)
    final = [c for c in committed if marker is not None and c.step == marker.step]
    window = committed[-1:] if stopping or marker is not None else committed[-keep:]  # the grace is the final's
    waiting, finished_steps = [], []
    for ckpt in final + [c for c in reversed(window) if c not in final]:  # the final first, then newest first
        identity = _identity(ckpt)
        if identity is None or identity in given_up:
            continue
        if identity in done:
            finished_steps.append(ckpt.step)
        else:
            waiting.append((ckpt, identity))
    anchor = max(finished_steps, default=None)
    newest = waiting[0] if waiting and waiting[0][0].step == committed[-1].step else None
    if waiting and is_node_part(waiting[0][0]) and marker is None and (len(waiting) > 1 or newest is None):
        try:
            started = (started_steps or StartedSteps(remote)).get(fresh=newest is not None)
        except StorageError as e:  # a preference only: the push that follows retries, or ends the watch
            logger.info("cannot see which steps other nodes have started (%s); uploading the newest", e)
            return None if newest is None else (*newest, anchor)
        chosen = next((c for c in waiting if c[0].step in started), newest)
        return None if chosen is None else (*chosen, anchor)
    return (*waiting[0], anchor) if waiting else None
