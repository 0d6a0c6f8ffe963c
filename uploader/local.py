"""The local checkpoint folder: names, atomic commit, listing, retention and the "finished" marker.

Layout::

    <folder>/step-000000000120/{state.pt, manifest.json}   committed checkpoints
    <folder>/.staging-step-000000000120-<pid>/              in progress, invisible to readers
    <folder>/FINISHED                                       the job is done (the sidecar may exit)

A checkpoint is written into a staging folder, its files fsynced, the manifest written last, the
folder renamed into place and the parent fsynced: a checkpoint is complete or invisible. The same
code serves the job (writer) and the sidecar (reader), so both agree on what "committed" means.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Collection

from uploader.exceptions import CorruptCheckpoint, ManifestError, UnsupportedFormat
from uploader.hashing import fsync_path
from uploader.manifest import MANIFEST_NAME, Manifest

logger = logging.getLogger(__name__)

PREFIX = "step-"
STAGING_PREFIX = ".staging-"
FINISHED_NAME = "FINISHED"
_NAME_RE = re.compile(r"^step-(\d{12})$")


def checkpoint_name(step: int) -> str:
    """Zero-padded so that names sort like steps, locally and in a bucket listing."""
    return f"{PREFIX}{step:012d}"


def parse_step(name: str) -> int | None:
    m = _NAME_RE.match(name)
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
    """Committed checkpoints (folder name parses and a manifest exists), oldest first. Not verified."""
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        step = parse_step(entry.name)
        if step is not None and (entry / MANIFEST_NAME).is_file():
            found.append(LocalCheckpoint(entry, step))
    return sorted(found, key=lambda c: c.step)


def newest_verified(folder: Path) -> tuple[LocalCheckpoint, Manifest] | None:
    """The newest checkpoint whose files match its manifest; corrupt ones are skipped with a warning,
    one from a newer spot-trainer is refused (UnsupportedFormat)."""
    for ckpt in reversed(list_committed(folder)):
        try:
            manifest = ckpt.manifest()
            manifest.verify(ckpt.path)
        except UnsupportedFormat as e:
            raise UnsupportedFormat(f"checkpoint {ckpt.path}: {e}") from None
        except (CorruptCheckpoint, ManifestError) as e:
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
    if final.exists():
        old = staging.parent / f"{STAGING_PREFIX}old-{final.name}-{os.getpid()}"
        final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        staging.rename(final)
    fsync_path(staging.parent)
    return LocalCheckpoint(final, manifest.step)


def clean_staging(folder: Path) -> None:
    """Remove leftovers of saves that died half-way (they were never visible)."""
    if not folder.is_dir():
        return
    for entry in folder.iterdir():
        if entry.name.startswith(STAGING_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)


def prune(folder: Path, keep: int, protect: Collection[Path] = ()) -> list[Path]:
    """Delete all but the newest ``keep`` committed checkpoints; returns what was removed.

    ``protect`` lists checkpoints still needed by someone else (an upload in progress): they stay
    until a later prune, so a fast save cadence can never delete a checkpoint under its uploader.
    """
    if keep < 1:
        raise ValueError("keep must be >= 1")
    removed = []
    protected = {Path(p) for p in protect}
    for ckpt in list_committed(folder)[:-keep]:
        if ckpt.path in protected:
            continue
        # Remove the manifest first so a crash half-way leaves an incomplete (ignored) folder,
        # never a committed one with missing files.
        (ckpt.path / MANIFEST_NAME).unlink(missing_ok=True)
        shutil.rmtree(ckpt.path, ignore_errors=True)
        removed.append(ckpt.path)
    return removed


@dataclass(frozen=True)
class Finished:
    """The job's last word: its final committed step, why it ended, and when it said so."""

    step: int
    reason: str
    mtime: float


def mark_finished(folder: Path, step: int, reason: str = "completed") -> None:
    """Tell a sidecar that the job has ended (completed, preempted or failed) and ``step`` is its last checkpoint."""
    tmp = folder / f".{FINISHED_NAME}.tmp"
    tmp.write_text(json.dumps({"step": step, "reason": reason}))
    os.replace(tmp, folder / FINISHED_NAME)
    fsync_path(folder)


def finished_marker(folder: Path) -> Finished | None:
    """The FINISHED marker, or None while the job runs (or a malformed marker, with a warning)."""
    path = folder / FINISHED_NAME
    try:
        doc = json.loads(path.read_text())
        return Finished(step=int(doc["step"]), reason=str(doc.get("reason", "completed")),
                        mtime=path.stat().st_mtime)
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        logger.warning("ignoring malformed %s in %s", FINISHED_NAME, folder)
        return None


def read_finished(folder: Path) -> int | None:
    """The last step the job marked as final, or None while it still runs."""
    marker = finished_marker(folder)
    return marker.step if marker is not None else None


def clear_finished(folder: Path) -> None:
    """A job that starts (or resumes) is not finished, whatever an older run left behind."""
    (folder / FINISHED_NAME).unlink(missing_ok=True)
