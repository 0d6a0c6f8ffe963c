"""The local checkpoint folder: names, atomic commit, listing, retention and the "finished" marker.

Layout::

    <folder>/step-000000000120/{state.pt, manifest.json}   committed checkpoints
    <folder>/.staging-step-000000000120-<pid>/              in progress, invisible to readers
    <folder>/corrupt-step-000000000064-<time>/              failed verification: set aside, kept
    <folder>/FINISHED                                       the job is done (the sidecar may exit)

A checkpoint is written into a staging folder, its files fsynced, the manifest written last, the
folder renamed into place and the parent fsynced: a checkpoint is complete or invisible. The same
code serves the job (writer) and the sidecar (reader), so both agree on what "committed" means.

What is never lost (README, "What is never lost"): retention counts back from the checkpoint just
committed and never deletes it, nor anything newer; a checkpoint that fails verification is renamed
out of the way (``corrupt-...``), never counted, chosen or deleted again; names are ASCII digits only,
and symbolic links are never followed, listed as checkpoints, or deleted through.
"""
from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from uploader.exceptions import CorruptCheckpoint, LocalAccessError, ManifestError, UnsupportedFormat
from uploader.hashing import fsync_path
from uploader.manifest import MANIFEST_NAME, Manifest, node_part, open_regular
from uploader.once import warn_once

logger = logging.getLogger(__name__)

PREFIX = "step-"
STAGING_PREFIX = ".staging-"
CORRUPT_PREFIX = "corrupt-"
FINISHED_NAME = "FINISHED"
# ASCII digits only: \d would take any script's digits ("step-١٢..."), which int() reads but which sort
# after every real step.
_NAME_RE = re.compile(r"step-([0-9]{12})", re.ASCII)
_OLD_RE = re.compile(rf"{re.escape(STAGING_PREFIX)}old-(step-[0-9]{{12}})-[0-9]+", re.ASCII)
MAX_FINISHED_BYTES = 4096


def checkpoint_name(step: int) -> str:
    """Zero-padded so that names sort like steps, locally and in a bucket listing."""
    return f"{PREFIX}{step:012d}"


def parse_step(name: str) -> int | None:
    m = _NAME_RE.fullmatch(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class LocalCheckpoint:
    path: Path
    step: int

    @property
    def name(self) -> str:
        return self.path.name

    def manifest(self) -> Manifest:
        return Manifest.read(self.path)


def list_committed(folder: Path) -> list[LocalCheckpoint]:
    """Committed checkpoints (folder name parses, a real folder with a regular manifest), oldest
    first. Not verified. A symbolic link is never a checkpoint: it is not listed, so nothing chooses
    it, and retention never deletes through it (another run's files may be behind it)."""
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        step = parse_step(entry.name)
        if step is not None and _is_real_dir(entry) and _is_regular(entry / MANIFEST_NAME):
            found.append(LocalCheckpoint(entry, step))
    return sorted(found, key=lambda c: c.step)


# A manifest that cannot tell what a checkpoint is: damaged, or not this user's to read. Listing, retention and a
# pull's look at the local copy skip such a checkpoint (and leave it as it is); only one chosen to be resumed or
# uploaded stops the run on it (exit 3 for a permission: uploader.manifest).
UNREADABLE_MANIFEST = (CorruptCheckpoint, ManifestError, LocalAccessError)


def is_node_part(ckpt: LocalCheckpoint) -> bool:
    """Whether ``ckpt`` is one node's part of a multi-node checkpoint (never resumable alone); an
    unreadable manifest counts as not (verification deals with it, if it is ever the one chosen: one this
    user may not read must not stop the job from listing the others)."""
    try:
        return node_part(ckpt.manifest()) is not None
    except UNREADABLE_MANIFEST:
        return False


def list_set_aside(folder: Path) -> list[Path]:
    """Checkpoints set aside after failing verification (:func:`set_aside`), by name."""
    if not folder.is_dir():
        return []
    return sorted(e for e in folder.iterdir() if e.name.startswith(CORRUPT_PREFIX + PREFIX) and _is_real_dir(e))


def set_aside(ckpt: LocalCheckpoint, reason: str) -> Path | None:
    """Rename a checkpoint that failed verification out of the way, kept for inspection: it is never
    listed, counted in ``keep``, chosen or deleted again. None if it is gone already (pruned meanwhile)."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = ckpt.path.parent / f"{CORRUPT_PREFIX}{ckpt.name}-{stamp}-{os.getpid()}"
    try:
        ckpt.path.rename(target)
        fsync_path(ckpt.path.parent)
    except FileNotFoundError:
        return None
    except OSError as e:  # a read-only folder: still skipped, just not renamed
        logger.warning("skipping corrupt checkpoint %s: %s; it cannot be set aside: %s", ckpt.path, reason,
                       e.strerror or e)
        return None
    logger.warning("skipping corrupt checkpoint %s: %s; set aside as %s, kept for inspection",
                   ckpt.path, reason, target.name)
    return target


def newest_verified(folder: Path, set_aside_corrupt: bool = False) -> tuple[LocalCheckpoint, Manifest] | None:
    """The newest whole checkpoint whose files match its manifest (a node's part of a multi-node one is
    not resumable alone: uploader.sync commits the whole); corrupt ones are skipped with a warning
    (and renamed out of the way when ``set_aside_corrupt``: the job's start-up); one from a newer
    spot-trainer is refused (UnsupportedFormat)."""
    for ckpt in reversed(list_committed(folder)):
        try:
            manifest = ckpt.manifest().for_step(ckpt.step)
            if node_part(manifest) is not None:
                logger.debug("%s is one node's part of a multi-node checkpoint, not resumable alone", ckpt.path)
                continue
            manifest.verify(ckpt.path)
        except UnsupportedFormat as e:
            raise UnsupportedFormat(f"checkpoint {ckpt.path}: {e}") from None
        except (CorruptCheckpoint, ManifestError) as e:
            if set_aside_corrupt:
                set_aside(ckpt, str(e))
            else:
                logger.warning("skipping corrupt checkpoint %s: %s", ckpt.path, e)
            continue
        return ckpt, manifest
    return None


def nearest_existing(folder: Path) -> Path:
    """``folder`` or the nearest folder above it that exists: what decides whether ``folder`` can be
    made, judged without making anything (a run refused for a bad flag leaves no trace)."""
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def staging_dir(folder: Path, step: int) -> Path:
    """A fresh, private folder to write a checkpoint into before it is committed."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{STAGING_PREFIX}{checkpoint_name(step)}-{os.getpid()}"
    if path.exists():
        shutil.rmtree(path)
    path.mkdir()
    return path


def remove_abandoned_staging(folder: Path, step: int) -> list[Path]:
    """Remove the staging folders of step ``step`` left by processes that no longer run (a pull killed
    with its whole checkpoint's room reserved, uploader.sync), so that the next pull finds that room;
    the removed ones. A folder of a process still running, or of one this process cannot tell about
    (another user's), is left alone; one with this process's own id is staging_dir's to replace."""
    removed = []
    for path in folder.glob(f"{STAGING_PREFIX}{checkpoint_name(step)}-*"):
        pid = path.name.rpartition("-")[2]
        if not pid.isdigit() or int(pid) == os.getpid() or path.is_symlink() or not path.is_dir():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive
        except ProcessLookupError:
            pass
        except (PermissionError, OverflowError):
            continue  # alive but not ours, or no such id at all
        shutil.rmtree(path)
        removed.append(path)
    return removed


def commit(staging: Path, manifest: Manifest) -> LocalCheckpoint:
    """Write the manifest last, then rename the staging folder into place, durably.

    The data files must already be written, and fsynced by the caller unless another copy is durable
    (a pull: uploader.sync). If a checkpoint of the same step exists (a re-save after resume), it is
    replaced only after the new one is complete.
    """
    manifest_path = staging / MANIFEST_NAME
    with open(manifest_path, "wb") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    fsync_path(staging)
    final = staging.parent / checkpoint_name(manifest.step)
    # A crash between the two renames leaves the old copy as .staging-old-*: clean_staging puts it back.
    if os.path.lexists(final):
        old = staging.parent / f"{STAGING_PREFIX}old-{final.name}-{os.getpid()}"
        final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(final)
    fsync_path(staging.parent)
    return LocalCheckpoint(final, manifest.step)


def clean_staging(folder: Path) -> None:
    """Remove leftovers of saves that died half-way (they were never visible), after putting back a
    checkpoint that a same-step re-commit had moved aside when the process died before the new one
    took its place (:func:`commit`). Symbolic links are removed, never followed."""
    if not folder.is_dir():
        return
    for entry in sorted(folder.iterdir()):
        m = _OLD_RE.fullmatch(entry.name)
        if m and _is_real_dir(entry) and not os.path.lexists(folder / m.group(1)):
            try:
                entry.rename(folder / m.group(1))
            except FileNotFoundError:  # another node's start-up put it back first (one shared volume)
                continue
            fsync_path(folder)
            logger.warning("put back %s, moved aside by a re-save that did not finish", m.group(1))
    for entry in folder.iterdir():
        if entry.name.startswith(STAGING_PREFIX):
            if entry.is_symlink() or not entry.is_dir():
                entry.unlink(missing_ok=True)
            else:
                shutil.rmtree(entry, ignore_errors=True)


def prune(folder: Path, keep: int, newest: int, protect: Collection[Path] = ()) -> list[Path]:
    """Keep the checkpoint of step ``newest`` (the one just committed) and the ``keep - 1`` committed
    ones before it; delete the older ones. Returns what was removed.

    Counting back from the checkpoint just committed, never from the highest step on disk: a newer
    one (another run's, or one a reader could not verify) is neither counted nor deleted, so it can
    never push good work out; nor is an older one whose manifest does not parse or names another step
    (garbage is no checkpoint, and not retention's to judge: it is left, with a warning). ``protect``
    lists checkpoints still needed by someone else (an upload in progress): they stay until a later
    prune, so a fast save cadence can never delete a checkpoint under its uploader.
    """
    if keep < 1:
        raise ValueError("keep must be >= 1")
    removed = []
    protected = {Path(p) for p in protect}
    older = [c for c in list_committed(folder) if c.step == newest or (c.step < newest and _counted(c))]
    for ckpt in older[:-keep]:
        if ckpt.path in protected or ckpt.step == newest:
            continue
        # Remove the manifest first so a crash half-way leaves an incomplete (ignored) folder,
        # never a committed one with missing files.
        (ckpt.path / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(ckpt.path, ignore_errors=True)
        removed.append(ckpt.path)
    return removed


def _counted(ckpt: LocalCheckpoint) -> bool:
    """Whether :func:`prune` may count, and so delete, a committed checkpoint: its manifest parses and is for
    its own step (its files are not read: that is verification's job)."""
    try:
        ckpt.manifest().for_step(ckpt.step)
        problem = None
    except UNREADABLE_MANIFEST as e:
        problem = str(e)
    if problem is not None:  # the job prunes after every save
        warn_once(logger, ("local retention", str(ckpt.path), problem),
                  "retention: %s is neither counted nor deleted: %s; delete it by hand once inspected", ckpt.path,
                  problem)
    return problem is None


@dataclass(frozen=True)
class Finished:
    """The job's last word: its final committed step, why it ended, and when it said so."""

    step: int
    reason: str
    mtime: float


def mark_finished(folder: Path, step: int, reason: str = "completed") -> None:
    """Tell a sidecar that the job has ended (completed, preempted or failed) and ``step`` is its last checkpoint.

    On one volume that several nodes share, every node's first process marks it at once, with the same
    words: each writes a file of its own (a name of one shared by all was renamed away under the others:
    exit 1 at the end of a finished run), and the last rename wins. A file left by a process killed in
    between is staging, removed at the next start (clean_staging)."""
    tmp = folder / f"{STAGING_PREFIX}{FINISHED_NAME}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.write_text(json.dumps({"step": step, "reason": reason}))
    os.replace(tmp, folder / FINISHED_NAME)
    fsync_path(folder)


def finished_marker(folder: Path) -> Finished | None:
    """The FINISHED marker, or None while the job runs (or a malformed marker, with a warning)."""
    path = folder / FINISHED_NAME
    try:
        with open_regular(path) as f:
            doc = json.loads(f.read(MAX_FINISHED_BYTES))
            mtime = os.fstat(f.fileno()).st_mtime
        return Finished(step=int(doc["step"]), reason=str(doc.get("reason", "completed")), mtime=mtime)
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError, OSError):
        logger.warning("ignoring malformed %s in %s", FINISHED_NAME, folder)
        return None


def read_finished(folder: Path) -> int | None:
    """The last step the job marked as final, or None while it still runs."""
    marker = finished_marker(folder)
    return marker.step if marker is not None else None


def clear_finished(folder: Path) -> None:
    """A job that starts (or resumes) is not finished, whatever an older run left behind."""
    (folder / FINISHED_NAME).unlink(missing_ok=True)


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except PermissionError as e:  # a checkpoint folder this user may not enter: skipped, it was never uploaded
        raise not_readable(path.parent, e) from None
    except OSError:
        return False


def local_read_error(path: Path, e: OSError) -> LocalAccessError | CorruptCheckpoint:
    """What an upload's failure to read a local checkpoint file is: a user who may not read it
    (LocalAccessError, exit 3, the file left as it is) or a file that is not what it should be
    (CorruptCheckpoint: uploader.sync sets the checkpoint aside)."""
    if isinstance(e, PermissionError):
        return not_readable(path, e)
    return CorruptCheckpoint(f"cannot read {path}: {e.strerror or e}")


def not_readable(path: Path, e: OSError) -> LocalAccessError:
    """A sidecar running as another user than the job: its checkpoints are good, only not readable here.
    Setting them aside as corrupt (as before) lost the newest one to every later start; skipping them, a
    watch that saw the job finish exited 0 with nothing uploaded."""
    return LocalAccessError(f"cannot read {path}: {e.strerror or e}; run the uploader as a user that may read "
                            "the job's checkpoints (the job's uid, or a shared group and fsGroup); the checkpoint "
                            "is left as it is")
