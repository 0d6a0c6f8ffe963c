"""The commit protocol between a local checkpoint folder and a Remote: push, list, pull, retention.

Push: data files first (each skipped if the remote already holds it with the same size and digest,
so an interrupted upload resumes), the manifest last, then ``latest`` (only ever forward, and only
after an upload, unless it names a checkpoint that is gone: _advance_latest), then retention. A remote
checkpoint without its manifest is incomplete and is never pulled; if a *different* checkpoint of
the same step is already remote, its manifest is deleted before any of its files are replaced. Two
remote manifests of that step are never replaced, and the upload stops before it deletes or writes
anything: one a newer spot-trainer wrote (UnsupportedFormat, in a pull's words: exit 6), and a key the
remote cannot read as an object (file://: a folder, link or FIFO in its place; CorruptCheckpoint, exit
6), which only a person should remove. Only a local checkpoint that fails its own checks (its manifest,
or a file that does not match it: LocalCheckpointError) is ever set aside by ``sync`` and ``watch``;
damage in the remote is never a reason to set good local work aside.

Pull: list the remote (``latest`` is never trusted), take complete checkpoints newest first,
download into a local staging folder while hashing, compare with the manifest, and commit it with
uploader.local.commit; a checkpoint that does not verify is skipped with a warning. The downloaded
files are not fsynced, only the manifest and the rename: the remote keeps the durable copy, and a
pulled checkpoint torn by a power cut fails its verification on the next start-up, like any corrupt
one, and is pulled again (job.app.choose). Waiting for the disk would cost a resume a second pass
at disk speed (8 s per GiB on a 125 MB/s cloud volume) for nothing. A local disk that cannot take the
download is LocalWriteError, never a reason to skip or set aside the remote checkpoint: it is not the
checkpoint that is wrong.

Retention counts back from the checkpoint just uploaded (verified byte for byte on its way up): it
keeps that one and the ``keep - 1`` complete ones before it, and deletes older ones, manifest first,
then data, so a crash half-way leaves an incomplete (ignored) checkpoint, never a complete one with
missing files. Only a checkpoint whose manifest reads, parses and is for its own step counts (one GET
of each manifest up to the one just uploaded): one whose manifest does not (garbage, another step's, a
newer format's) is neither counted, so it can never push good work out, nor deleted, with a warning.
A complete checkpoint *newer* than the one just uploaded (another run's, or one that failed a
reader's verification and could not be set aside) is neither counted nor deleted, so it can never
push good work out. Incomplete leftovers older than the one just uploaded (uploads that died)
are deleted too, once their newest object is YOUNG_UPLOAD_S older than the manifest just written (until
then it may be another uploader's upload still going: two sidecars on one prefix, a sync beside one);
newer ones are kept because a resumed upload continues them. Whatever retention deletes, an upload writes
its manifest only after one listing of its prefix shows every file it names with its size (DataVanished
otherwise: not uploaded, tried again by the next pass), so a checkpoint is never complete without its data.

Multi-node (no shared volume): each node commits its own part of a checkpoint locally, with
``meta.node``, ``meta.nodes`` and the save's ``meta.save_id`` in its manifest, and uploads it from
that node (its in-process uploader or its own sidecar): its data files first, then its part's
manifest at ``<name>/nodes/node-K-of-N.json``, last. Then it lists the parts; the node that sees all
N of one save (at least the last one to finish does: S3 lists what was written before) verifies
that every file is there with its size and writes the whole checkpoint's ``manifest.json``, whose
bytes depend on the parts alone, so two nodes committing at once write the same object. A node
killed before its part's manifest, or during the commit, leaves the checkpoint incomplete, never
used. The sidecars never talk to each other. Retention runs after every upload and deletes only
once the checkpoint just uploaded is complete: the node whose part completes it applies it.

Set aside: a complete remote checkpoint whose files fail verification on a pull (or whose manifest
is invalid) is moved to ``corrupt-<name>-<time>/`` (copied, then the manifest and data deleted),
where listing, pulls and retention never look: kept for inspection, never chosen again. That needs
write access; a reader without it only skips the checkpoint. Before moving anything the manifest is
read again, and a checkpoint whose manifest changed meanwhile (a re-save) is left alone.
"""
from __future__ import annotations

import contextlib
import logging
import shutil
import stat
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from uploader.destination import Destination, local_writes
from uploader.exceptions import (
    CorruptCheckpoint,
    DataVanished,
    LocalCheckpointError,
    LocalCorruptCheckpoint,
    LocalUnsupportedFormat,
    LocalWriteError,
    ManifestError,
    RemoteInTheWay,
    StorageError,
    UnsupportedFormat,
)
from uploader.hashing import tagged
from uploader.layout import (
    LATEST_KEY,
    checkpoint_of,
    data_key,
    latest_document,
    manifest_key,
    node_key,
    parse_node_key,
)
from uploader.local import (
    CORRUPT_PREFIX,
    LocalCheckpoint,
    checkpoint_name,
    commit,
    list_committed,
    not_readable,
    remove_abandoned_staging,
    set_aside,
    staging_dir,
)
from uploader.manifest import (MANIFEST_NAME, MAX_MANIFEST_BYTES, FileEntry, Manifest, lstat_inside, node_part,
                               open_regular, strict_json)
from uploader.once import warn_once
from uploader.progress import Progress, human_bytes
from uploader.remote import ObjectInfo, Remote

logger = logging.getLogger(__name__)

# An incomplete remote checkpoint whose newest object is younger than this (next to the checkpoint just
# uploaded) may be another uploader's upload in flight, not a dead one: retention leaves it (_dead_uploads).
# The window it guards is from that upload's listing of its data (_check_still_there, right after its last
# file) to its manifest landing: one PUT, within its retry budget (--max-retry-seconds, 120 s by default).
# Data deleted before that listing is found missing there. Longer only keeps more dead uploads: those that
# died within it before a run's last upload stay until the next run's first (review 38: 30 min was that).
YOUNG_UPLOAD_S = 10 * 60.0


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


def newest_complete(remote: Remote, below: int | None = None) -> tuple[int, Manifest] | None:
    """The newest checkpoint (before step ``below``, when given) whose manifest exists and parses (its
    files are not checked here)."""
    for ckpt in reversed([c for c in list_remote(remote) if c.complete and (below is None or c.step < below)]):
        manifest = _remote_manifest(remote, ckpt, remote.read_bytes(manifest_key(ckpt.name), limit=MAX_MANIFEST_BYTES))
        if manifest is not None:
            return ckpt.step, manifest
    return None


def is_complete(remote: Remote, step: int) -> bool:
    """Whether the remote holds a complete checkpoint of ``step``: its manifest is there and parses, for that
    step (its files are not checked here)."""
    raw = remote.read_bytes(manifest_key(checkpoint_name(step)), limit=MAX_MANIFEST_BYTES)
    if raw is None:
        return False
    try:
        Manifest.from_json(raw).whole_for_step(step)
    except ManifestError:
        return False
    return True


def steps_other_nodes_started(remote: Remote) -> set[int]:
    """Steps whose checkpoint is not complete but holds some node's part: uploading this node's part of
    one of those completes it, or brings it closer (uploader.watch)."""
    started = set()
    for name, objects in _scan(remote).items():
        summary = _summarize(name, objects)
        if not summary.complete and any(parse_node_key(name, o.key) is not None for o in objects):
            started.add(summary.step)
    return started


def list_set_aside(remote: Remote) -> list[str]:
    """Names of the remote checkpoints set aside after failing verification (``corrupt-step-...``)."""
    return sorted({o.key.partition("/")[0] for o in remote.list(CORRUPT_PREFIX)})


def push(ckpt: LocalCheckpoint, remote: Remote, keep: int, *, abort: threading.Event | None = None,
         anchor: int | None = None) -> None:
    """Upload one committed local checkpoint (resuming a partial upload), then apply retention, counting back
    from ``anchor`` (a newer step the caller has uploaded: uploader.watch's catch-up of older ones), by default
    from this one.

    Raises LocalCorruptCheckpoint if a local file no longer matches the manifest (or vanished: the job's
    local pruning can remove a checkpoint while it is being uploaded); the remote is then left with
    an incomplete checkpoint that is never used. Raises UnsupportedFormat or CorruptCheckpoint, having
    changed nothing, when the remote's manifest of this step must not be replaced (module docstring), and
    RemoteInTheWay (file://) when something it did not write stands where a data file goes, and DataVanished
    (not uploaded: no manifest written) when some of its data was deleted from the remote meanwhile.
    """
    _check_keep(keep)
    uploaded = _upload(ckpt, remote, abort)
    _after_commit(remote, keep, ckpt.step if anchor is None else max(anchor, ckpt.step), uploaded=uploaded)


def push_all(folder: Path, remote: Remote, keep: int, *, abort: threading.Event | None = None) -> list[int]:
    """Upload the newest ``keep`` committed local checkpoints that are not complete remotely, oldest
    first, then apply retention once, counting back from the newest of them now complete remotely.
    A local checkpoint that does not match its manifest is set aside (uploader.local.set_aside) with a
    warning and the next older one takes its place; a remote step that must not be replaced stops the
    sync (module docstring). Returns the steps uploaded. DataVanished (exit 5 for ``uploader sync``) once
    the others are done and retention has run, where a step's data vanished before its manifest: it is not in
    the remote, and a one-shot sync has no next pass to upload it, so saying so is the caller's only way to
    know."""
    _check_keep(keep)
    pushed: list[int] = []
    vanished: list[DataVanished] = []
    anchor: int | None = None
    candidates = list_committed(folder)
    while candidates:
        batch, candidates = candidates[-keep:], candidates[:-keep]
        failed = 0
        for ckpt in batch:
            try:
                if _upload(ckpt, remote, abort):
                    pushed.append(ckpt.step)
            except DataVanished as e:
                vanished.append(e)
                continue  # not complete remotely: never counted as uploaded, nor an anchor of retention
            except LocalCheckpointError as e:
                set_aside_local(ckpt, e)
                failed += 1
                continue
            anchor = ckpt.step if anchor is None else max(anchor, ckpt.step)
        if anchor is not None or not failed:
            break
    if anchor is not None:
        _after_commit(remote, keep, anchor, uploaded=bool(pushed))
    if vanished:
        raise vanished[-1]
    return sorted(pushed)


def set_aside_local(ckpt: LocalCheckpoint, error: LocalCheckpointError) -> None:
    """A local checkpoint that failed to upload because it does not verify: set it aside, unless it
    is being pruned (its manifest gone: the job's retention got there first) or a newer build wrote it.
    Only for LocalCheckpointError: a failure of the remote is never the local checkpoint's. A checkpoint
    saved again while it was uploaded (its manifest is not the one the upload read) is the new save,
    which did not fail: it is left alone and uploaded by the next pass."""
    if error.manifest is not None and _manifest_bytes(ckpt) != error.manifest:
        logger.warning("not uploading local %s: %s; it was saved again meanwhile, left as it is", ckpt.name, error)
    elif (ckpt.path / MANIFEST_NAME).is_file() and not isinstance(error, UnsupportedFormat):
        set_aside(ckpt, str(error))
    else:
        logger.warning("skipping local %s: %s", ckpt.name, error)


def _manifest_bytes(ckpt: LocalCheckpoint) -> bytes | None:
    try:
        return _read_manifest(ckpt)
    except OSError:
        return None


def _read_manifest(ckpt: LocalCheckpoint) -> bytes:
    """A local manifest's bytes, as far as one can be (one byte more: too long to parse)."""
    with open_regular(ckpt.path / MANIFEST_NAME) as f:
        return f.read(MAX_MANIFEST_BYTES + 1)


def pull_newest(remote: Remote, folder: Path, *, abort: threading.Event | None = None,
                set_aside_corrupt: bool = True, step: int | None = None, above: int = -1) -> LocalCheckpoint | None:
    """Make the newest complete, verified remote checkpoint (of ``step``, when given; newer than step
    ``above``, when given) a committed local one; None if there is none. ``above``: the caller has a
    good one of that step, so an older one is not worth a download (nor the disk it would take).

    If the same step already exists locally and verifies, nothing is downloaded. A remote checkpoint
    that fails verification is skipped, and set aside in the remote when ``set_aside_corrupt`` and the
    credentials allow it (module docstring).
    """
    for ckpt in reversed([c for c in list_remote(remote) if c.complete and step in (None, c.step) and c.step > above]):
        raw = remote.read_bytes(manifest_key(ckpt.name), limit=MAX_MANIFEST_BYTES)
        manifest = _remote_manifest(remote, ckpt, raw)
        if manifest is None:
            if raw is not None and set_aside_corrupt:
                _set_aside_remote(remote, ckpt.name, raw, "its manifest is invalid")
            continue
        local = _verified_local(folder, ckpt.step)
        if local is not None:
            logger.info("%s is already in %s and verifies; nothing to download", ckpt.name, folder)
            return local
        try:
            pulled = _download(remote, ckpt.name, manifest, folder, abort)
        except CorruptCheckpoint as e:
            logger.warning("skipping remote %s: %s; trying the previous checkpoint", ckpt.name, e)
            if set_aside_corrupt:
                _set_aside_remote(remote, ckpt.name, raw, str(e))
            continue
        logger.info("pulled %s (%d files, %d bytes) from %s into %s", ckpt.name, len(manifest.files),
                    manifest.total_size, remote.url, pulled.path)
        return pulled
    return None


def pull_files(remote: Remote, manifest: Manifest, paths: Collection[str], dest: Path, *,
               abort: threading.Event | None = None) -> int:
    """Download only ``paths`` of the complete remote checkpoint ``manifest`` describes into ``dest``, each
    verified byte for byte against the manifest as it streams; the bytes downloaded. For a node resuming
    its part of a multi-node checkpoint (job.node_pull): ``dest`` (made if missing) is a scratch folder,
    never a committed checkpoint, since it does not hold every file.

    CorruptCheckpoint when a file is missing or differs (the caller decides whether to set it aside).
    """
    name = checkpoint_name(manifest.step)
    entries = {f.path: f for f in manifest.files}
    unknown = sorted(set(paths) - entries.keys())
    if unknown:
        raise CorruptCheckpoint(f"{name}: its manifest lists no {', '.join(map(repr, unknown[:3]))}")
    wanted = [entries[p] for p in sorted(set(paths))]
    size = sum(f.size for f in wanted)
    with _landing(name, size, dest):
        with local_writes(dest):
            dest.mkdir(parents=True, exist_ok=True)
        _fetch(remote, name, wanted, dest, f"download {len(wanted)} of {len(entries)} files of {name}", abort)
    return size


def set_aside_if_unchanged(remote: Remote, manifest: Manifest, reason: str) -> None:
    """Set the remote checkpoint of ``manifest`` aside (module docstring) when its manifest is still the
    one that failed: a checkpoint re-saved meanwhile is left alone."""
    name = checkpoint_name(manifest.step)
    raw = remote.read_bytes(manifest_key(name), limit=MAX_MANIFEST_BYTES)
    if raw is None or _parse_or_none(raw) != manifest:
        logger.warning("remote %s changed while it was verified; not setting it aside", name)
        return
    _set_aside_remote(remote, name, raw, reason)


# -- push ---------------------------------------------------------------------------------------


def _check_keep(keep: int) -> None:
    if keep < 1:
        raise ValueError(f"keep must be >= 1, not {keep}")


def _upload(ckpt: LocalCheckpoint, remote: Remote, abort: threading.Event | None) -> bool:
    """Data, then the manifest (a node's part: its part manifest, then the commit if all parts are
    there). False if the remote already had this exact checkpoint (or part)."""
    raw, manifest = _local_manifest(ckpt)
    part = node_part(manifest)
    marker = manifest_key(ckpt.name) if part is None else node_key(ckpt.name, *part)
    existing_raw, existing = _replaceable(remote, ckpt.name, marker)
    # A node's part: the whole checkpoint's manifest too, which this upload may delete or (committing) replace.
    whole = None if part is None else _replaceable(remote, ckpt.name, manifest_key(ckpt.name))[1]
    if existing_raw is not None:
        if existing == manifest:
            logger.debug("%s is already on %s", marker, remote.url)
            if part is not None:  # the node that came last may have died before committing
                _commit_parts(remote, ckpt.name, manifest)
            return False
        # A different save of the same step (e.g. a re-save after resume): make the remote one
        # incomplete before touching its files, so nobody pulls a mix of the two.
        logger.info("replacing the different remote %s on %s", marker, remote.url)
        remote.delete([manifest_key(ckpt.name)] + ([marker] if part is not None else []))
    elif whole is not None and whole.meta.get("save_id") != manifest.meta.get("save_id"):
        remote.delete([manifest_key(ckpt.name)])  # another save's commit: never a mix of two saves
    progress = Progress(f"upload {ckpt.name}", manifest.total_size)
    skipped = 0
    for entry in manifest.files:
        key = data_key(ckpt.name, entry.path)
        there = remote.head(key)
        if there is not None and there.size == entry.size and there.digest == tagged(entry.algorithm, entry.digest):
            skipped += 1
            progress.add(entry.size)
            continue
        try:
            _put_file(remote, key, ckpt, entry, progress, abort)
        except LocalCheckpointError as e:
            e.manifest = raw  # what was being uploaded: set_aside_local leaves a re-save alone
            raise
    if part is None:  # a node's part is checked, with every other part, by _commit_parts
        _check_still_there(remote, ckpt.name, manifest.files)
    remote.write_bytes(marker, raw)
    if part is None:  # and again: another's retention may have deleted the data between the check and the write
        _check_still_there(remote, ckpt.name, manifest.files, written=marker)
    progress.close()
    logger.info("uploaded %s to %s (%d files, %d bytes%s)", marker if part else ckpt.name, remote.url,
                len(manifest.files), manifest.total_size, f", {skipped} already there" if skipped else "")
    if part is not None:
        _commit_parts(remote, ckpt.name, manifest)
    return True


def _missing_files(remote: Remote, name: str, files: Sequence[FileEntry],
                   objects: Sequence[ObjectInfo] | None = None) -> list[str]:
    """The paths of ``files`` that are not in the remote checkpoint ``name`` with their size, seen in one
    listing of its prefix (``objects``, when the caller has one): cheaper than a HEAD per file."""
    sizes = {o.key: o.size for o in (remote.list(f"{name}/") if objects is None else objects)}
    return [f.path for f in files if sizes.get(data_key(name, f.path)) != f.size]


def _check_still_there(remote: Remote, name: str, files: Sequence[FileEntry], written: str | None = None) -> None:
    """Right before a manifest is written: every file it names must be in the remote with its size. Another
    uploader on the same prefix (two sidecars on one folder, a hand-run sync beside one) took this upload,
    still without its manifest, for a dead one, and its retention deleted the data: a manifest written now
    would make a complete checkpoint without its data. DataVanished then (a TransientStorageError): the
    upload is not done, the step is not reported uploaded, and the next pass (the watch's next poll, the
    in-process uploader's retry, the next sync) uploads again what is missing. No retry here: whoever
    deleted it has just uploaded a newer complete checkpoint, so nothing is lost meanwhile, and an
    immediate retry would race the same retention again. Asked again right after the manifest is ``written``:
    that retention may have come between the first look and the write (an upload whose files were all there
    long since is no young upload to it); the manifest is then deleted again, so the step stays incomplete."""
    missing = _missing_files(remote, name, files)
    if missing and written is not None:  # the manifest just written is taken back: the checkpoint is incomplete
        remote.delete([written])
    if missing:
        raise DataVanished(
            f"{name} on {remote.url}: {', '.join(missing[:3])}{' and more' if len(missing) > 3 else ''} vanished "
            "after being uploaded (another uploader on this prefix deleted it as a dead upload?); its manifest "
            "is not kept, so it is not uploaded; upload it again (the next pass of a watch or of the job does)")


def _replaceable(remote: Remote, name: str, key: str) -> tuple[bytes | None, Manifest | None]:
    """The remote manifest at ``key`` that an upload of checkpoint ``name`` would replace: its bytes (None if
    there is none) and what they parse to (None for damage, replaced like a different save).

    Raises, before the upload deletes or writes anything, for what must stay as it is: a newer spot-trainer's
    manifest (UnsupportedFormat, as a pull words it), and a key the remote cannot read as an object
    (CorruptCheckpoint of the remote: file:// refuses to delete or write through what is there)."""
    try:
        raw = remote.read_bytes(key, limit=MAX_MANIFEST_BYTES)
    except CorruptCheckpoint as e:
        raise CorruptCheckpoint(f"cannot upload {name} to {remote.url}: {e}; remove that entry from the remote, "
                                "then upload again (the local checkpoint is kept as it is)") from None
    try:
        return raw, None if raw is None else Manifest.from_json(raw)
    except UnsupportedFormat as e:
        raise _newer_format(remote, name, e) from None
    except ManifestError:
        return raw, None


def _put_file(remote: Remote, key: str, ckpt: LocalCheckpoint, entry: FileEntry, progress: Progress,
              abort: threading.Event | None) -> None:
    """One data file up. put_file's CorruptCheckpoint is about the local file (unreadable, or not what the
    manifest says: Remote.put_file), so it is the local checkpoint's fault.

    The file must be a regular one of the manifest's size, reached without a symbolic link: a link
    planted in a checkpoint folder sent whatever it named to the bucket (a file elsewhere on the node,
    or /dev/zero without end), and a sparse file of 50 GB was read whole before its digest refused it."""
    path = ckpt.path / entry.path
    try:
        st = lstat_inside(ckpt.path, entry.path)
    except PermissionError as e:
        raise not_readable(path, e) from None
    except OSError as e:
        raise LocalCorruptCheckpoint(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size != entry.size:
        what = f"{st.st_size} bytes" if stat.S_ISREG(st.st_mode) else "not a regular file"
        raise LocalCorruptCheckpoint(f"{path} is {what}, the manifest says a file of {entry.size} bytes; "
                                     "not uploading it")
    try:
        remote.put_file(key, path, size=entry.size, digest=entry.digest, algorithm=entry.algorithm,
                        block_size=entry.block_size, on_bytes=progress.add, abort=abort)
    except CorruptCheckpoint as e:
        raise LocalCorruptCheckpoint(str(e)) from None


def _local_manifest(ckpt: LocalCheckpoint) -> tuple[bytes, Manifest]:
    """The manifest of the local checkpoint to upload, raw and parsed (its node fields checked too);
    LocalCheckpointError if it cannot be used."""
    try:
        raw = _read_manifest(ckpt)
    except PermissionError as e:
        raise not_readable(ckpt.path / MANIFEST_NAME, e) from None
    except OSError as e:
        raise LocalCorruptCheckpoint(f"{ckpt.path}: cannot read its manifest ({e.strerror or e})") from None
    try:
        manifest = Manifest.from_json(raw).for_step(ckpt.step)
        node_part(manifest)
    except UnsupportedFormat as e:
        raise LocalUnsupportedFormat(str(e)) from None
    except ManifestError as e:
        raise LocalCorruptCheckpoint(f"{ckpt.path}: {e}") from None
    return raw, manifest


def _commit_parts(remote: Remote, name: str, mine: Manifest) -> bool:
    """Write the whole checkpoint's manifest once every node's part of this save is uploaded.

    Each node, after its own part, lists the parts; whichever sees all of them (S3 lists what was
    written before: at least the last node does) writes the whole manifest. Its bytes are a function
    of the parts alone, so two nodes that both commit write the same object. Parts of another save
    (another ``save_id``), malformed ones and files missing or of the wrong size keep it incomplete.
    """
    node_count = mine.meta["nodes"]
    objects = remote.list(f"{name}/")  # one listing: the parts' manifests and every file's size
    parts: dict[int, Manifest] = {}
    for obj in objects:
        parsed = parse_node_key(name, obj.key)
        if parsed is None or parsed[1] != node_count:
            continue
        part = _parse_or_none(remote.read_bytes(obj.key, limit=MAX_MANIFEST_BYTES) or b"")
        if part is not None and node_part(part) == parsed and part.step == mine.step \
                and part.meta.get("save_id") == mine.meta.get("save_id"):
            parts[parsed[0]] = part
    if len(parts) < node_count:
        logger.info("%s on %s: %d of %d nodes' parts uploaded; the node that comes last commits it",
                    name, remote.url, len(parts), node_count)
        return False
    files = [f for node in sorted(parts) for f in parts[node].files]
    missing = _missing_files(remote, name, files, objects)
    first = parts[0]
    try:
        if missing:
            raise ManifestError(f"{missing[0]} is missing or of another size")
        whole = Manifest(step=mine.step, files=tuple(sorted(files, key=lambda f: f.path)), timer=first.timer,
                         meta={k: v for k, v in first.meta.items() if k != "node"},
                         created=max(p.created for p in parts.values()),
                         # the newest of the parts' formats, which reads every older one's digests (a part of an
                         # older build, in a rolling update, failed a format 2 whole with BLAKE3 digests: exit 1)
                         format_version=max(p.format_version for p in parts.values()))
        raw = whole.to_json()
        Manifest.from_json(raw)  # the whole must be a checkpoint the job can load (payload, layout)
    except ManifestError as e:
        logger.warning("not committing %s on %s: its parts do not make a checkpoint (%s)", name, remote.url, e)
        return False
    if remote.read_bytes(manifest_key(name), limit=MAX_MANIFEST_BYTES) != raw:
        remote.write_bytes(manifest_key(name), raw)
        logger.info("committed %s on %s: all %d nodes' parts are uploaded", name, remote.url, node_count)
    latest = _latest_step(remote)
    if latest is None or latest < mine.step:
        _point_latest(remote, mine.step)
    return True


def _latest_step(remote: Remote) -> int | None:
    """The step the remote's ``latest`` names; None for anything else (it is a hint, and untrusted: 2,100
    nested brackets raised RecursionError through json.loads, exit 1)."""
    try:
        step = strict_json(remote.read_bytes(LATEST_KEY, limit=4096) or b"")["step"]
    except (ValueError, KeyError, TypeError, CorruptCheckpoint):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _point_latest(remote: Remote, step: int) -> None:
    """Point ``latest`` at ``step``. Pulls list the remote and never need it, so something in its place
    (file://: a folder) is named in a warning and the upload stands."""
    try:
        remote.write_bytes(LATEST_KEY, latest_document(step))
    except RemoteInTheWay as e:
        logger.warning("latest on %s is not updated: %s", remote.url, e)


def _advance_latest(remote: Remote, newest: int, summaries: Sequence[RemoteCheckpoint], uploaded: bool) -> int | None:
    """Point ``latest`` at ``newest`` only where that moves it forward, and only after an upload: an older
    local step (another node's disk, a snapshot, the watch catching up) or one already there never takes it
    back. A ``latest`` that names no complete checkpoint (deleted, set aside, never written, malformed) is
    wrong whatever was uploaded: it then names the newest complete one whose manifest makes a checkpoint.
    Returns the step ``latest`` names now."""
    current = _latest_step(remote)
    complete = {c.step for c in summaries if c.complete}
    if current is not None and current in complete:
        if current > newest:
            logger.info("latest on %s stays at step %d, newer than %s", remote.url, current, checkpoint_name(newest))
        if current >= newest or not uploaded:
            return current
        _point_latest(remote, newest)
        return newest
    newer = (c for c in reversed(summaries) if c.complete and c.step > newest and _unusable(remote, c) is None)
    target = next((c.step for c in newer), newest)
    if current is not None:
        logger.info("latest on %s named step %d, which is not complete there; pointing it at %s", remote.url,
                    current, checkpoint_name(target))
    _point_latest(remote, target)
    return target


def _after_commit(remote: Remote, keep: int, newest: int, *, uploaded: bool = True) -> None:
    """Point ``latest`` at ``newest`` (the checkpoint just uploaded) where that moves it forward
    (_advance_latest), then delete what retention lets go, counting back from it (module docstring).
    ``uploaded``: False when the remote already had it all. Nothing while ``newest`` is not complete: a node's
    part that others' parts have yet to join. The node whose upload completes it deletes, whichever that
    is (two that commit at once delete the same keys); a node 0 that alone deleted never did while it
    uploaded first, and the bucket grew without bound."""
    scan = _scan(remote)
    summaries = [_summarize(name, objects) for name, objects in scan.items()]
    complete = [c for c in summaries if c.complete and c.step <= newest and _counted(remote, c)]
    if not complete or complete[-1].step != newest:
        logger.info("retention waits: %s is not complete on %s", checkpoint_name(newest), remote.url)
        return
    latest = _advance_latest(remote, newest, summaries, uploaded)
    ignored = [c.name for c in summaries if c.complete and c.step > newest]
    if ignored:
        warn_once(logger, ("remote retention, newer", remote.url, tuple(ignored)),
                  "retention: %s on %s %s newer than the checkpoint just uploaded (%s): neither counted nor deleted",
                  ", ".join(ignored), remote.url, "is" if len(ignored) == 1 else "are", checkpoint_name(newest))
    doomed = complete[:-keep] + _dead_uploads(remote, summaries, complete[-1])
    for ckpt in sorted(doomed, key=lambda c: c.step):
        keys = [o.key for o in scan[ckpt.name]]
        manifest = manifest_key(ckpt.name)
        if manifest in keys:
            remote.delete([manifest])  # first: from here on the checkpoint is incomplete, never half-used
        remote.delete([k for k in keys if k != manifest])
        logger.info("retention: deleted %s %s from %s (keeping %d up to %s)",
                    "complete" if ckpt.complete else "incomplete", ckpt.name, remote.url, keep,
                    checkpoint_name(newest))
    if latest in {c.step for c in doomed}:  # it named one it kept (not moved back): now gone
        _point_latest(remote, newest)


def _dead_uploads(remote: Remote, summaries: Sequence[RemoteCheckpoint],
                  newest: RemoteCheckpoint) -> list[RemoteCheckpoint]:
    """Incomplete checkpoints older than ``newest`` (the one just uploaded) that retention deletes: uploads
    that died. One whose newest object was written less than YOUNG_UPLOAD_S before ``newest``'s manifest (both
    times are the remote's own clock: no skew) may be another uploader's, still going (two sidecars on one
    prefix, a hand-run sync beside one): it is kept, and deleted by the first pass after it is that old. An
    upload that loses its data anyway writes no manifest (_check_still_there)."""
    dead = []
    for ckpt in summaries:
        if ckpt.complete or ckpt.step >= newest.step:
            continue
        if newest.created - ckpt.created < YOUNG_UPLOAD_S:
            logger.info("retention: keeping incomplete %s on %s: written %.0f s before %s, it may be another "
                        "uploader's still going; deleted once %.0f s old", ckpt.name, remote.url,
                        max(0.0, newest.created - ckpt.created), newest.name, YOUNG_UPLOAD_S)
            continue
        dead.append(ckpt)
    return dead


def _counted(remote: Remote, ckpt: RemoteCheckpoint) -> bool:
    """Whether retention may count, and so delete, a listed complete checkpoint (module docstring): a manifest
    listed is not yet a checkpoint. One that is not is left alone, with a warning."""
    problem = _unusable(remote, ckpt)
    if problem is not None:
        warn_once(logger, ("remote retention", remote.url, ckpt.name, problem),
                  "retention: %s on %s is neither counted nor deleted: %s; delete it by hand once inspected",
                  ckpt.name, remote.url, problem)
    return problem is None


def _unusable(remote: Remote, ckpt: RemoteCheckpoint) -> str | None:
    """Why the manifest of a listed checkpoint does not make one (it must read, parse, and be for its own
    step); None if it does."""
    try:
        raw = remote.read_bytes(manifest_key(ckpt.name), limit=MAX_MANIFEST_BYTES)
        if raw is not None:
            Manifest.from_json(raw).whole_for_step(ckpt.step)
    except (CorruptCheckpoint, ManifestError) as e:
        return str(e)
    return "its manifest disappeared" if raw is None else None


def _set_aside_remote(remote: Remote, name: str, raw: bytes | None, reason: str) -> None:
    """Move a remote checkpoint that failed verification to ``corrupt-<name>-<time>/`` (module docstring).
    Best effort: without write access, or with the storage failing, it is only skipped."""
    target = f"{CORRUPT_PREFIX}{name}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    manifest = manifest_key(name)
    try:
        if remote.read_bytes(manifest, limit=MAX_MANIFEST_BYTES) != raw:
            logger.warning("remote %s changed while it was verified; not setting it aside", name)
            return
        objects = remote.list(f"{name}/")
        for obj in sorted(objects, key=lambda o: o.key == manifest):  # the manifest last
            remote.copy(obj.key, f"{target}/{obj.key.partition('/')[2]}", size=obj.size)
        remote.delete([manifest])  # first: from here on nobody takes it as complete
        remote.delete([o.key for o in objects if o.key != manifest])
    except (StorageError, CorruptCheckpoint) as e:
        logger.warning("remote %s failed verification (%s) and could not be set aside: %s", name, reason, e)
        return
    logger.warning("remote %s failed verification (%s); set aside as %s/ on %s, kept for inspection",
                   name, reason, target, remote.url)


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


def _newer_format(remote: Remote, name: str, e: UnsupportedFormat) -> UnsupportedFormat:
    """A remote checkpoint a newer spot-trainer wrote, refused (exit 6) in the same words by pulls and uploads."""
    return UnsupportedFormat(f"{remote.url}/{name}: {e}")


def _remote_manifest(remote: Remote, ckpt: RemoteCheckpoint, raw: bytes | None) -> Manifest | None:
    """The parsed manifest (``raw``) of a complete remote checkpoint; None (with a warning) if unusable;
    UnsupportedFormat if a newer spot-trainer wrote it."""
    if raw is None:
        logger.warning("skipping remote %s: its manifest disappeared (retention running?)", ckpt.name)
        return None
    try:
        return Manifest.from_json(raw).whole_for_step(ckpt.step)
    except UnsupportedFormat as e:
        raise _newer_format(remote, ckpt.name, e) from None
    except ManifestError as e:
        logger.warning("skipping remote %s: %s", ckpt.name, e)
        return None


# -- pull ---------------------------------------------------------------------------------------


def _verified_local(folder: Path, step: int) -> LocalCheckpoint | None:
    """The local whole checkpoint of ``step`` if it verifies (a node's part is not the whole)."""
    for ckpt in list_committed(folder):
        if ckpt.step == step:
            try:
                manifest = ckpt.manifest()
                if node_part(manifest) is not None:
                    return None
                manifest.verify(ckpt.path)
            except UNREADABLE_MANIFEST:
                return None
            return ckpt
    return None


def _download(
    remote: Remote, name: str, manifest: Manifest, folder: Path, abort: threading.Event | None
) -> LocalCheckpoint:
    with _landing(name, manifest.total_size, folder):
        with local_writes(folder):
            for abandoned in remove_abandoned_staging(folder, manifest.step):
                logger.info("removed %s, a download of %s whose process is gone (its room was reserved)",
                            abandoned, name)
            staging = staging_dir(folder, manifest.step)
        try:
            _fetch(remote, name, manifest.files, staging, f"download {name}", abort)
            with local_writes(folder):
                return commit(staging, manifest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # the space it took is given back at once
            raise


def _fetch(remote: Remote, name: str, entries: Sequence[FileEntry], base: Path, what: str,
           abort: threading.Event | None) -> None:
    """Download ``entries`` of checkpoint ``name`` into ``base``, each verified as it streams, after
    making room for all of them: a disk too small for the checkpoint fails before its first byte is
    fetched, not after the files that fit (a sharded checkpoint has many).

    Only sizes the remote confirms (its listing, or a look-up of the file) are reserved: a manifest that
    claims more bytes than are stored is a corrupt checkpoint (skipped, set aside), never a full disk."""
    stored = {o.key: o.size for o in remote.list(f"{name}/")}
    for entry in entries:
        key = data_key(name, entry.path)
        if stored.get(key) != entry.size:  # asked again before calling it damage: a listing may skip or lag
            info = remote.head(key)  # a folder it cannot read raises here (AuthError, StorageError)
            if info is None:
                raise CorruptCheckpoint(f"{remote.url}/{key} is missing")
            if info.size != entry.size:
                raise CorruptCheckpoint(f"{remote.url}/{key} has {info.size} bytes, the manifest says {entry.size}")
    targets = [(entry, _inside(base, entry.path)) for entry in entries]
    with local_writes(base):
        for entry, target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            Destination(target, entry.size).close()  # get_file opens it as it is: its room stays reserved
    progress = Progress(what, sum(entry.size for entry in entries))
    for entry, target in targets:
        remote.get_file(data_key(name, entry.path), target, size=entry.size, digest=entry.digest,
                        algorithm=entry.algorithm, block_size=entry.block_size, on_bytes=progress.add, abort=abort)
    progress.close()


@contextlib.contextmanager
def _landing(name: str, size: int, folder: Path) -> Iterator[None]:
    """A download's local write failing (a full disk, a quota, a read-only volume) is one line naming the
    checkpoint, the folder and the room it needs; exit code 7 at both CLIs."""
    try:
        yield
    except LocalWriteError as e:
        raise LocalWriteError(f"cannot download {name} ({human_bytes(size)}) into {folder}: {e.reason}; "
                              f"{e.advice} (the remote checkpoint is untouched)", e.reason, e.errno) from None


def _inside(staging: Path, relpath: str) -> Path:
    """The destination of a manifest entry; refuses anything resolving outside the staging folder.

    Manifest.from_json already refuses absolute and '..' paths; this is the second lock on the door.
    """
    dest = (staging / relpath).resolve()
    if not dest.is_relative_to(staging.resolve()):
        raise CorruptCheckpoint(f"manifest entry {relpath!r} points outside the checkpoint folder")
    return dest
