"""Errors of the storage side. Each says what is wrong and what to do, in one line.

The CLI maps each class to one exit code (see uploader.cli); library callers (the job) catch the
class they can act on. Messages name the bucket and endpoint but never a credential.
"""
from __future__ import annotations

import errno as _errno


class UploaderError(Exception):
    """Base class: anything the storage side refuses or cannot do."""


class ManifestError(UploaderError):
    """A manifest that cannot be trusted: unknown format, bad JSON, or unsafe paths."""


class UnsupportedFormat(ManifestError):
    """A manifest from a newer spot-trainer (a higher format_version). Refused, never skipped like a
    corrupt one: resuming from an older checkpoint instead would redo the work and then write over,
    or prune, the newer checkpoint."""


class CorruptCheckpoint(UploaderError):
    """A checkpoint whose files do not match its manifest (size or digest), or are missing."""


class LocalCheckpointError(UploaderError):
    """Raised by an upload (uploader.sync) when the *local* checkpoint is at fault, never the remote: only this
    may make ``sync`` and ``watch`` set the local checkpoint aside. Damage found in the remote (an entry that is
    not an object, a newer build's checkpoint of the same step) is never a reason to set good local work aside."""

    manifest: bytes | None = None  # the local manifest the failed upload had read, when it got that far


class LocalCorruptCheckpoint(LocalCheckpointError, CorruptCheckpoint):
    """A local checkpoint being uploaded whose files do not match its manifest, or whose manifest cannot be
    read or used."""


class LocalUnsupportedFormat(LocalCheckpointError, UnsupportedFormat):
    """A local checkpoint being uploaded that a newer spot-trainer wrote: skipped, never set aside."""


class NoCheckpointFound(UploaderError):
    """A pull found no complete checkpoint that verifies under the remote prefix."""


class StorageError(UploaderError):
    """The storage refused a request for a reason that retrying will not fix (and that is not one below)."""


class AuthError(StorageError):
    """Missing or wrong credentials, or the credentials may not access the bucket (403). Never retried."""


class LocalAccessError(AuthError):
    """A local checkpoint file or folder this process may not read (EACCES, EPERM): a matter of users and
    modes, never of the checkpoint, which is left as it is (exit 3, as a remote that refuses access)."""


class RemoteInTheWay(StorageError):
    """Something the upload did not write stands where it must write (file://: a folder where an object
    goes): only a person should remove it (exit 6, as for a remote manifest that is not an object)."""


class BucketNotFound(StorageError):
    """The bucket (or, for file://, the folder above the remote path) does not exist. Never retried."""


class TransientStorageError(StorageError):
    """The storage stayed unreachable, slow or throttling after every retry the UploadConfig allows."""


class DataVanished(TransientStorageError):
    """Data files of a checkpoint were gone from the remote (or of another size) when its upload came to write
    the manifest: another uploader on the same prefix (a second sidecar, a hand-run sync) took them for a dead
    upload and its retention deleted them. The manifest is not written, so the checkpoint stays incomplete,
    never a complete one without its data; the upload is not done, and the next try uploads what is missing."""


class LocalWriteError(UploaderError):
    """A download could not be written to the local disk: full, over a quota, read-only or failing.
    Nothing remote changed, and no retry is made: only freeing space (or another folder) helps.
    ``reason`` is the system's own words (``No space left on device``) and ``errno`` its number, for a
    caller that rewords."""

    def __init__(self, message: str, reason: str = "", errno: int | None = None) -> None:
        super().__init__(message)
        self.reason, self.errno = reason or message, errno

    @property
    def advice(self) -> str:
        """What to do about it, by the system's reason."""
        if self.errno in (_errno.ENOSPC, _errno.EDQUOT):
            return "make room there or use another folder"
        if self.errno == _errno.EFBIG:  # RLIMIT_FSIZE (ulimit -f), or the filesystem's largest file (FAT32)
            return "raise the file size limit (ulimit -f) or use another filesystem"
        return "use a folder this process can write"


class BadSettings(UploaderError):
    """The storage settings are unusable, before any request: an endpoint, region or bucket name the S3
    client refuses, which may come from the environment (AWS_ENDPOINT_URL, AWS_REGION) past the CLI's own
    checks. Bad configuration (exit 2), not a bug, nor a failure a retry or the next start would fix."""


class Aborted(UploaderError):
    """A transfer was stopped on request (grace period over, uploader closed); the remote is unchanged."""


class DeadlineExceeded(TimeoutError):
    """An attempt ran past its wall-clock deadline and its connection was cut (uploader.deadline). A
    TimeoutError, not an UploaderError: it is transient, and the retry layer (uploader.retry) then stops
    because the deadline is its budget's end; what reaches a caller is the error that retry layer raises."""
