"""The commit protocol between a local checkpoint folder and a Remote: push, list, pull, retention.

Push: data files first (each skipped if the remote already holds it with the same size and sha256,
so an interrupted upload resumes), the manifest last, then ``latest``, then retention. A remote
checkpoint without its manifest is incomplete and is never pulled; if a *different* checkpoint of
the same step is already remote, its manifest is deleted before any of its files are replaced.

Pull: list the remote (``latest`` is never trusted), take complete checkpoints newest first,
download into a local staging folder while hashing, compare with the manifest, and commit it with
uploader.local.commit; a checkpoint that does not verify is skipped with a warning. The downloaded
files are not fsynced, only the manifest and the rename: the remote keeps the durable copy, and a
pulled checkpoint torn by a power cut fails its verification on the next start-up, like any corrupt
one, and is pulled again (job.app.choose). Waiting for the disk would cost a resume a second pass
at disk speed (8 s per GiB on a 125 MB/s cloud volume) for nothing.

Retention keeps the newest ``keep`` complete checkpoints. It deletes an older one only once
``keep`` newer ones are complete, manifest first, then data, so a crash half-way leaves an
incomplete (ignored) checkpoint, never a complete one with missing files. Incomplete leftovers older
than the newest complete checkpoint (uploads that died) are deleted too; newer ones are kept because
a resumed upload continues them.
"""
from __future__ import annotations

import logging
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from uploader.exceptions import CorruptCheckpoint, ManifestError, UnsupportedFormat
from uploader.layout import LATEST_KEY, checkpoint_of, data_key, latest_document, manifest_key
from uploader.local import LocalCheckpoint, commit, list_committed, staging_dir
from uploader.manifest import MANIFEST_NAME, Manifest
from uploader.progress import Progress
from uploader.remote import ObjectInfo, Remote

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteCheckpoint:
    """One checkpoint prefix as the listing shows it. ``complete`` means its manifest exists
    (not that its files verify: pull checks that). ``size`` counts every object, manifest included;
    ``created`` is when the manifest (or, while incomplete, the newest object) was written."""

    step: int
    name: str
    complete: bool
    size: int
    created: float


def list_remote(remote: Remote) -> list[RemoteCheckpoint]:
    """Every checkpoint prefix under the remote, complete or not, oldest first."""
    return [_summarize(name, objects) for name, objects in _scan(remote).items()]


def newest_complete(remote: Remote) -> tuple[int, Manifest] | None:
    """The newest checkpoint whose manifest exists and parses (its files are not checked here)."""
    for ckpt in reversed([c for c in list_remote(remote) if c.complete]):
        manifest = _remote_manifest(remote, ckpt)
        if manifest is not None:
            return ckpt.step, manifest
    return None


def push(ckpt: LocalCheckpoint, remote: Remote, keep: int, *, abort: threading.Event | None = None) -> None:
    """Upload one committed local checkpoint (resuming a partial upload), then apply retention.

    Raises CorruptCheckpoint if a local file no longer matches the manifest (or vanished: the job's
    local pruning can remove a checkpoint while it is being uploaded); the remote is then left with
    an incomplete checkpoint that is never used.
    """
    _check_keep(keep)
    _upload(ckpt, remote, abort)
    _after_commit(remote, keep)


def push_all(folder: Path, remote: Remote, keep: int, *, abort: threading.Event | None = None) -> list[int]:
    """Upload every committed local checkpoint that is not complete remotely, oldest first, then
    apply retention once. Checkpoints that retention would delete at once (older than the newest
    ``keep`` of local and remote together) are not uploaded; a local checkpoint that does not
    match its manifest is skipped with a warning. Returns the steps uploaded."""
    _check_keep(keep)
    remote_complete = {c.step for c in list_remote(remote) if c.complete}
    local = list_committed(folder)
    survivors = sorted(remote_complete | {c.step for c in local})[-keep:]
    pushed = []
    for ckpt in local:
        if ckpt.step not in survivors:
            continue
        try:
            if _upload(ckpt, remote, abort):
                pushed.append(ckpt.step)
        except (CorruptCheckpoint, ManifestError) as e:
            logger.warning("skipping local %s: %s", ckpt.name, e)
    _after_commit(remote, keep)
    return pushed


def pull_newest(remote: Remote, folder: Path, *, abort: threading.Event | None = None) -> LocalCheckpoint | None:
    """Make the newest complete, verified remote checkpoint a committed local one; None if there is none.

    If the same step already exists locally and verifies, nothing is downloaded.
    """
    for ckpt in reversed([c for c in list_remote(remote) if c.complete]):
        manifest = _remote_manifest(remote, ckpt)
        if manifest is None:
            continue
        local = _verified_local(folder, ckpt.step)
        if local is not None:
            logger.info("%s is already in %s and verifies; nothing to download", ckpt.name, folder)
            return local
        try:
            pulled = _download(remote, ckpt.name, manifest, folder, abort)
        except CorruptCheckpoint as e:
            logger.warning("skipping remote %s: %s; trying the previous checkpoint", ckpt.name, e)
            continue
        logger.info("pulled %s (%d files, %d bytes) from %s into %s", ckpt.name, len(manifest.files),
                    manifest.total_size, remote.url, pulled.path)
        return pulled
    return None


# -- push ---------------------------------------------------------------------------------------


def _check_keep(keep: int) -> None:
    if keep < 1:
        raise ValueError(f"keep must be >= 1, not {keep}")


def _upload(ckpt: LocalCheckpoint, remote: Remote, abort: threading.Event | None) -> bool:
    """Data, then manifest. False if the remote already had this exact checkpoint complete."""
    try:
        raw = (ckpt.path / MANIFEST_NAME).read_bytes()
    except OSError as e:
        raise CorruptCheckpoint(f"{ckpt.path}: cannot read its manifest ({e.strerror})") from None
    manifest = Manifest.from_json(raw)
    if manifest.step != ckpt.step:
        raise CorruptCheckpoint(f"{ckpt.path}: its manifest is for step {manifest.step}")
    existing_raw = remote.read_bytes(manifest_key(ckpt.name))
    if existing_raw is not None:
        if _parse_or_none(existing_raw) == manifest:
            logger.debug("%s is already complete on %s", ckpt.name, remote.url)
            return False
        # A different save of the same step (e.g. a re-save after resume): make the remote one
        # incomplete before touching its files, so nobody pulls a mix of the two.
        logger.info("replacing the different remote %s on %s", ckpt.name, remote.url)
        remote.delete([manifest_key(ckpt.name)])
    progress = Progress(f"upload {ckpt.name}", manifest.total_size)
    skipped = 0
    for entry in manifest.files:
        key = data_key(ckpt.name, entry.path)
        there = remote.head(key)
        if there is not None and there.size == entry.size and there.sha256 == entry.sha256:
            skipped += 1
            progress.add(entry.size)
            continue
        remote.put_file(key, ckpt.path / entry.path, size=entry.size, sha256=entry.sha256,
                        block_size=entry.block_size, on_bytes=progress.add, abort=abort)
    remote.write_bytes(manifest_key(ckpt.name), raw)
    progress.close()
    logger.info("uploaded %s to %s (%d files, %d bytes%s)", ckpt.name, remote.url, len(manifest.files),
                manifest.total_size, f", {skipped} already there" if skipped else "")
    return True


def _after_commit(remote: Remote, keep: int) -> None:
    """Point ``latest`` at the newest complete checkpoint, then delete what retention lets go."""
    scan = _scan(remote)
    summaries = [_summarize(name, objects) for name, objects in scan.items()]
    complete = [c for c in summaries if c.complete]
    if not complete:
        return
    newest = complete[-1]
    remote.write_bytes(LATEST_KEY, latest_document(newest.step))
    doomed = complete[:-keep] + [c for c in summaries if not c.complete and c.step < newest.step]
    for ckpt in sorted(doomed, key=lambda c: c.step):
        keys = [o.key for o in scan[ckpt.name]]
        manifest = manifest_key(ckpt.name)
        if manifest in keys:
            remote.delete([manifest])  # first: from here on the checkpoint is incomplete, never half-used
        remote.delete([k for k in keys if k != manifest])
        logger.info("retention: deleted %s %s from %s (keeping the newest %d)",
                    "complete" if ckpt.complete else "incomplete", ckpt.name, remote.url, keep)


# -- listing ------------------------------------------------------------------------------------


def _scan(remote: Remote) -> dict[str, list[ObjectInfo]]:
    """Objects grouped by checkpoint name, in step order; keys outside checkpoints are ignored."""
    groups: dict[str, list[ObjectInfo]] = {}
    for obj in remote.list():
        parsed = checkpoint_of(obj.key)
        if parsed is not None:
            groups.setdefault(parsed[0], []).append(obj)
    return dict(sorted(groups.items()))


def _summarize(name: str, objects: list[ObjectInfo]) -> RemoteCheckpoint:
    parsed = checkpoint_of(objects[0].key)
    assert parsed is not None
    manifest = next((o for o in objects if o.key == manifest_key(name)), None)
    return RemoteCheckpoint(
        step=parsed[1],
        name=name,
        complete=manifest is not None,
        size=sum(o.size for o in objects),
        created=manifest.modified if manifest is not None else max(o.modified for o in objects),
    )


def _parse_or_none(raw: bytes) -> Manifest | None:
    try:
        return Manifest.from_json(raw)
    except ManifestError:
        return None


def _remote_manifest(remote: Remote, ckpt: RemoteCheckpoint) -> Manifest | None:
    """The parsed manifest of a complete remote checkpoint; None (with a warning) if unusable;
    UnsupportedFormat if a newer spot-trainer wrote it."""
    raw = remote.read_bytes(manifest_key(ckpt.name))
    if raw is None:
        logger.warning("skipping remote %s: its manifest disappeared (retention running?)", ckpt.name)
        return None
    try:
        manifest = Manifest.from_json(raw)
    except UnsupportedFormat as e:
        raise UnsupportedFormat(f"{remote.url}/{ckpt.name}: {e}") from None
    except ManifestError as e:
        logger.warning("skipping remote %s: %s", ckpt.name, e)
        return None
    if manifest.step != ckpt.step:
        logger.warning("skipping remote %s: its manifest is for step %d", ckpt.name, manifest.step)
        return None
    return manifest


# -- pull ---------------------------------------------------------------------------------------


def _verified_local(folder: Path, step: int) -> LocalCheckpoint | None:
    for ckpt in list_committed(folder):
        if ckpt.step == step:
            try:
                ckpt.manifest().verify(ckpt.path)
            except (CorruptCheckpoint, ManifestError):
                return None
            return ckpt
    return None


def _download(
    remote: Remote, name: str, manifest: Manifest, folder: Path, abort: threading.Event | None
) -> LocalCheckpoint:
    staging = staging_dir(folder, manifest.step)
    try:
        progress = Progress(f"download {name}", manifest.total_size)
        for entry in manifest.files:
            dest = _inside(staging, entry.path)
            dest.parent.mkdir(parents=True, exist_ok=True)
            remote.get_file(data_key(name, entry.path), dest, size=entry.size, sha256=entry.sha256,
                            block_size=entry.block_size, on_bytes=progress.add, abort=abort)
        progress.close()
        return commit(staging, manifest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _inside(staging: Path, relpath: str) -> Path:
    """The destination of a manifest entry; refuses anything resolving outside the staging folder.

    Manifest.from_json already refuses absolute and '..' paths; this is the second lock on the door.
    """
    dest = (staging / relpath).resolve()
    if not dest.is_relative_to(staging.resolve()):
        raise CorruptCheckpoint(f"manifest entry {relpath!r} points outside the checkpoint folder")
    return dest
