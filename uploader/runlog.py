"""The run log: what a run records about itself beside its checkpoints, mirrored to the remote.

    <save-folder>/runlog/ledger/life-<start>-<id>.json    one record per life of the run (job.ledger)
    <save-folder>/runlog/tensorboard/events.out.tfevents.* training curves (job.curves)
    <remote>/runlog/...                                   the same keys, uploaded after each checkpoint

Each life writes only files it created, so uploading is a mirror that only adds and overwrites, never
deletes: a life on a new disk does not hold the earlier lives' files, and the remote keeps them all.
Nothing here reads what it uploads: the files are records, not state, and a run never resumes from
them. Readers (``job report``, TensorBoard) treat them as untrusted input.
"""
from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from uploader.exceptions import CorruptCheckpoint
from uploader.manifest import open_regular
from uploader.remote import Remote

logger = logging.getLogger(__name__)

RUNLOG_DIR = "runlog"
LEDGER_DIR = f"{RUNLOG_DIR}/ledger"
# A life's record is a few KiB, a TensorBoard file grows by ~100 bytes a scalar; anything far larger is
# not ours, and reading it whole into memory to upload it would be the bigger risk.
MAX_RUNLOG_FILE = 256 * 1024 * 1024
MAX_LEDGER_ENTRY = 1024 * 1024


@dataclass(frozen=True)
class _Seen:
    size: int
    mtime_ns: int


class RunlogMirror:
    """Uploads each file under ``<folder>/runlog/`` that is new or changed since it was last uploaded.

    Called after each checkpoint upload and at the end (uploader.worker, uploader.watch); cheap when
    nothing changed (one stat per file). The first call compares with the remote's listing, so a
    restarted uploader does not upload again what an earlier one already did.
    """

    def __init__(self, folder: Path, remote: Remote) -> None:
        self.root = folder / RUNLOG_DIR
        self.remote = remote
        self._sent: dict[str, _Seen] | None = None
        self._said_not_a_folder = False

    def sync(self) -> int:
        """Upload what changed; the number of files uploaded. Storage errors propagate (the caller's
        retry policy for checkpoints applies); an unreadable or odd local file is skipped with a warning."""
        files = self._local_files()
        if not files:
            return 0
        if self._sent is None:
            self._sent = self._already_remote(files)
        uploaded = 0
        for key, path, seen in files:
            if self._sent.get(key) == seen:
                continue
            try:
                data = _read(path)
            except OSError as e:
                logger.warning("run log: cannot read %s (%s); not uploaded", path, e.strerror)
                continue
            self.remote.write_bytes(key, data)
            # What was read, not what the stat said: a file appended to meanwhile goes up again next time.
            self._sent[key] = _Seen(len(data), seen.mtime_ns) if len(data) == seen.size else _Seen(-1, 0)
            uploaded += 1
        if uploaded:
            logger.debug("run log: %d file(s) uploaded to %s", uploaded, self.remote.url)
        return uploaded

    def sync_or_warn(self) -> None:
        """:meth:`sync` for callers that upload checkpoints: the run log is a record, not state, so a
        failure never fails a checkpoint or the job; it is logged, and the next sync tries again."""
        try:
            self.sync()
        except Exception as e:  # noqa: BLE001 - logged; the next checkpoint tries again
            logger.warning("run log not uploaded to %s: %s; trying again after the next checkpoint",
                           self.remote.url, e)

    def _already_remote(self, files: list[tuple[str, Path, _Seen]]) -> dict[str, _Seen]:
        """Files whose remote copy is the local one. Append-only files (TensorBoard's) are compared by
        size; small ones, which their writer rewrites in place (a ledger record keeps its size when a
        step count changes), by content: object times are whole seconds on S3, too coarse to tell."""
        remote = {o.key: o for o in self.remote.list(f"{RUNLOG_DIR}/")}
        sent: dict[str, _Seen] = {}
        for key, path, seen in files:
            obj = remote.get(key)
            if obj is None or obj.size != seen.size:
                continue
            if seen.size <= MAX_LEDGER_ENTRY:
                try:
                    if self.remote.read_bytes(key, limit=MAX_LEDGER_ENTRY) != _read(path):
                        continue
                except OSError:
                    continue
            sent[key] = seen
        return sent

    def _local_files(self) -> list[tuple[str, Path, _Seen]]:
        """Regular files only, no symlinks (a link could point anywhere on the node), no dot files
        (a writer's temporary file before its rename)."""
        found: list[tuple[str, Path, _Seen]] = []
        try:  # os.walk follows a link given as its top: runlog/ itself must be a real folder
            if not stat.S_ISDIR(self.root.lstat().st_mode):
                if not self._said_not_a_folder:
                    logger.warning("run log: %s is not a folder (a link?); it is not uploaded", self.root)
                    self._said_not_a_folder = True
                return found
        except OSError:
            return found  # none yet
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not os.path.islink(
                os.path.join(dirpath, d)))
            for name in sorted(filenames):
                if name.startswith("."):
                    continue
                path = Path(dirpath) / name
                try:
                    st = path.lstat()
                except OSError:
                    continue  # gone since the listing
                if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_RUNLOG_FILE:
                    continue
                key = path.relative_to(self.root.parent).as_posix()
                found.append((key, path, _Seen(st.st_size, st.st_mtime_ns)))
        return found


def _read(path: Path) -> bytes:
    """A run log file as the listing saw it: never through a link swapped in since, never more than
    MAX_RUNLOG_FILE (+1, so that a file grown past it since shows as changed, not cut short)."""
    with open_regular(path) as f:
        return f.read(MAX_RUNLOG_FILE + 1)


def read_ledger(remote: Remote) -> list[tuple[str, bytes]]:
    """Every ledger entry under ``remote`` as (key, raw bytes), in key order, at most MAX_LEDGER_ENTRY + 1
    bytes of each; one that cannot be read is skipped with a warning. Parsing (and distrust, size included)
    is the reader's job.
    Storage errors (AuthError, BucketNotFound, an outage) propagate: a report missing lives would mislead."""
    entries: list[tuple[str, bytes]] = []
    for obj in remote.list(f"{LEDGER_DIR}/"):
        if not obj.key.endswith(".json"):
            continue
        try:
            raw = remote.read_bytes(obj.key, limit=MAX_LEDGER_ENTRY)
        except CorruptCheckpoint as e:  # not a plain readable object (file://: a link, a folder)
            logger.warning("run log: cannot read %s (%s); skipped", obj.key, e)
            continue
        if raw is not None:  # None: deleted since the listing
            entries.append((obj.key, raw))  # over MAX_LEDGER_ENTRY: its first bytes, for the reader to refuse
    return entries

