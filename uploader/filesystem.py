"""The file:// Remote: a shared volume or NFS mount standing in for a bucket.

Objects are files under the root folder; every write goes to a hidden temporary file in the same
folder, is fsynced and checked, then renamed into place, so a reader sees a whole object or none
(the same guarantee an S3 PUT gives). The digest is kept in a ``user.digest`` extended attribute
(``user.sha256`` from older builds is read too) where the file system supports it; where it does
not, a resumed upload simply re-copies the file.

Operations are not retried (see uploader.retry): OSErrors surface as StorageError at once, or as
AuthError (exit 3, as S3's 403) when the folder's permissions refuse this user or the volume is
read-only: that will not fix itself either, and says what to change.

The folder is untrusted like a bucket: objects are regular files only, and no key is reached through a
symbolic link below the root (a link to /dev/zero would be read forever, a linked folder would let
retention delete another run's files), so links are neither listed nor read, written or deleted
through. Reads stop at the size the caller expects.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

from uploader.destination import Destination
from uploader.exceptions import (Aborted, AuthError, BucketNotFound, CorruptCheckpoint, RemoteInTheWay,
                                 StorageError)
from uploader.hashing import CHUNK, StreamDigest, fsync_path, tagged
from uploader.local import local_read_error
from uploader.manifest import open_regular
from uploader.remote import ObjectInfo, OnBytes, file_location

logger = logging.getLogger(__name__)

TMP_MARKER = ".uploader-tmp-"
XATTR_DIGEST = "user.digest"  # uploader.hashing.tagged
XATTR_LEGACY = "user.sha256"  # what builds before format 3 kept (a sha256-family digest)


class FileRemote:
    """A Remote rooted at a local folder. The folder is created on first write; its parent must exist."""

    def __init__(self, root: Path) -> None:
        if not root.is_absolute():
            raise ValueError(f"file:// remotes need an absolute path, not {str(root)!r}")
        self.root = root
        self.url = f"file://{root}"

    @classmethod
    def from_url(cls, url: str) -> FileRemote:
        return cls(file_location(url))

    def describe(self) -> str:
        return f"folder {str(self.root)!r}"

    def cancel(self) -> None:
        """Nothing: a local file system has no peer to hang on, and copies check their ``abort`` per chunk."""

    def close(self) -> None:
        pass

    def _check_parent(self) -> None:
        if not self.root.parent.is_dir():
            raise BucketNotFound(f"{self.root.parent} does not exist: mount the shared volume or fix the file:// URL")

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        try:
            st = os.stat(self.root)  # one look: a folder being created meanwhile is never "a file"
        except FileNotFoundError:
            # The root is created on the first write; the folder above it is the "bucket". Missing too, it
            # is a volume not mounted: listed as empty, a run that should resume would start again.
            self._check_parent()
            return []
        except OSError as e:
            raise _refused(f"cannot list {self.describe()}", e) from None
        if not stat.S_ISDIR(st.st_mode):  # a typo'd URL naming a file would otherwise list as an empty remote
            raise BucketNotFound(f"{self.root} is a file, not a folder: fix the file:// URL")
        found = []
        try:
            for folder, dirs, files in os.walk(self.root, onerror=_unless_gone):  # never into linked folders
                dirs.sort()
                for name in files:
                    if name.startswith(TMP_MARKER):
                        continue
                    path = Path(folder, name)
                    key = path.relative_to(self.root).as_posix()
                    if key.startswith(prefix):
                        try:
                            st = os.lstat(path)
                        except FileNotFoundError:
                            continue  # deleted since the walk saw it
                        if stat.S_ISREG(st.st_mode):  # links and devices are not objects
                            found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        except OSError as e:
            raise _refused(f"cannot list {self.describe()}", e) from None
        return sorted(found, key=lambda o: o.key)

    def head(self, key: str) -> ObjectInfo | None:
        try:
            path = self._path(key)
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _refused(f"cannot stat {key} in {self.describe()}", e) from None
        if not stat.S_ISREG(st.st_mode):
            return None  # not an object: an upload replaces it (os.replace replaces a link, not its target)
        return ObjectInfo(key, st.st_size, st.st_mtime, _get_digest(path))

    def read_bytes(self, key: str, limit: int | None = None) -> bytes | None:
        try:
            with open_regular(self._path(key)) as f:
                return f.read() if limit is None else f.read(limit + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._read_error(key, e) from None

    def write_bytes(self, key: str, data: bytes) -> None:
        digest = hashlib.sha256(data).hexdigest()
        with self._atomic(key) as tmp:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            _set_digest(tmp, digest)

    def put_file(
        self,
        key: str,
        path: Path,
        *,
        size: int,
        digest: str,
        algorithm: str,
        block_size: int | None = None,
        on_bytes: OnBytes | None = None,
        abort: threading.Event | None = None,
    ) -> None:
        with contextlib.ExitStack() as stack:
            try:  # before anything is written: never through a link, never past the size (a planted /dev/zero)
                src = stack.enter_context(open_regular(path))
            except OSError as e:
                raise local_read_error(path, e) from None
            tmp = stack.enter_context(self._atomic(key))
            with open(tmp, "wb") as dst:
                actual_size, actual_digest = _copy(src, dst, block_size, algorithm, on_bytes, abort, limit=size + 1)
            if actual_size != size or actual_digest != digest:
                raise CorruptCheckpoint(f"{path} does not match its manifest (size or {algorithm}); not uploading it")
            _set_digest(tmp, tagged(algorithm, digest))

    def get_file(
        self,
        key: str,
        path: Path,
        *,
        size: int,
        digest: str,
        algorithm: str,
        block_size: int | None = None,
        on_bytes: OnBytes | None = None,
        abort: threading.Event | None = None,
    ) -> None:
        with self._open_object(key) as reader:
            stored = os.fstat(reader.fileno()).st_size
            if stored != size:  # before reserving the manifest's size: a damaged manifest is not a full disk
                raise CorruptCheckpoint(f"{self.url}/{key} has {stored} bytes, the manifest says {size}")
            with Destination(path, size) as dst:
                actual_size, actual_digest = _copy(reader, dst, block_size, algorithm, on_bytes, abort,
                                                   durable=False, limit=size + 1)
        if actual_size != size:
            raise CorruptCheckpoint(f"{self.url}/{key} has {'more than ' if actual_size > size else ''}"
                                    f"{min(actual_size, size)} bytes, the manifest says {size}")
        if actual_digest != digest:
            raise CorruptCheckpoint(f"{self.url}/{key} fails its {algorithm} check")

    def copy(self, source: str, dest: str, *, size: int) -> None:
        with self._open_object(source) as reader, self._atomic(dest) as tmp, open(tmp, "wb") as dst:
            shutil.copyfileobj(_Bounded(reader, size), dst, CHUNK)
            dst.flush()
            os.fsync(dst.fileno())

    def delete(self, keys: Sequence[str]) -> None:
        parents = set()
        for key in keys:
            try:
                path = self._path(key)
                path.unlink(missing_ok=True)
            except OSError as e:
                raise _refused(f"cannot delete {key} in {self.describe()}", e) from None
            parents.add(path.parent)
        # Remove folders left empty, deepest first, never the root itself.
        for folder in sorted(parents, key=lambda p: len(p.parts), reverse=True):
            while folder != self.root and self.root in folder.parents:
                try:
                    folder.rmdir()
                except OSError:
                    break
                folder = folder.parent

    # -- plumbing -------------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        """The file of a key; keys come from uploader.layout, but refuse escapes all the same, and a
        folder on the way that is a symbolic link (OSError ELOOP, which each caller maps)."""
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"unsafe key {key!r}")
        folder = self.root
        for part in parts[:-1]:
            folder = folder / part
            try:
                mode = os.lstat(folder).st_mode
            except FileNotFoundError:
                break  # not there yet: nothing below it can be a link
            if stat.S_ISLNK(mode):
                raise OSError(errno.ELOOP, "a symbolic link in the remote folder, refused", str(folder))
        return self.root.joinpath(*parts)

    @contextlib.contextmanager
    def _open_object(self, key: str) -> Iterator[BinaryIO]:
        """An object opened for reading: CorruptCheckpoint if it is missing or not a regular file."""
        with contextlib.ExitStack() as stack:
            try:
                f = stack.enter_context(open_regular(self._path(key)))
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{self.url}/{key} is missing") from None
            except OSError as e:
                raise self._read_error(key, e) from None
            yield f

    def _read_error(self, key: str, e: OSError) -> Exception:
        """A key that is a link, a folder or a device is damage (CorruptCheckpoint), not an outage."""
        if e.errno in (errno.ELOOP, errno.EINVAL, errno.EISDIR, errno.ENOTDIR, errno.ENXIO):
            return CorruptCheckpoint(f"{self.url}/{key} is not a regular file ({e.strerror or e}); refused")
        return _refused(f"cannot read {key} in {self.describe()}", e)

    @contextlib.contextmanager
    def _atomic(self, key: str) -> Iterator[Path]:
        """A temporary file next to the key's file, renamed into place if the block succeeds."""
        try:
            target = self._path(key)
        except OSError as e:
            raise _refused(f"cannot write {key} in {self.describe()}", e) from None
        self._check_parent()
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _refused(f"cannot create {target.parent}", e) from None
        tmp = target.parent / f"{TMP_MARKER}{target.name}-{uuid.uuid4().hex[:8]}"
        try:
            yield tmp
            os.replace(tmp, target)
            fsync_path(target.parent)
        except OSError as e:
            raise _refused(f"cannot write {target}", e) from None
        finally:  # a leftover to tidy, no more: on a read-only volume this fails too (EROFS), and its OSError
            with contextlib.suppress(OSError):  # replaced the refusal being raised (exit 3 became 1, "a bug")
                tmp.unlink(missing_ok=True)


_DENIED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
# A folder, or a link, where an object goes (or a file where a folder goes).
_IN_THE_WAY = frozenset({errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENOTEMPTY, errno.ELOOP})


def _unless_gone(e: OSError) -> None:
    """os.walk's error handler: a folder deleted since it was seen (retention, a set-aside) is not there
    any more; any other error (EACCES, NFS's EIO or ESTALE) fails the listing, which would otherwise
    leave that checkpoint out and make an older one look like the newest."""
    if not isinstance(e, FileNotFoundError):
        raise e


def _refused(what: str, e: OSError) -> StorageError:
    """``what`` failed: a permission problem (AuthError, exit 3), something in the way (RemoteInTheWay,
    exit 6; it was exit 1, "a bug", and a sidecar's crash loop) or any other (StorageError)."""
    if e.errno in _DENIED:
        return AuthError(f"{what}: {e.strerror}; this user (uid {os.getuid()}) needs to read and write there, "
                         "on a volume mounted read-write")
    if e.errno in _IN_THE_WAY:
        return RemoteInTheWay(f"{what}: {e.strerror}; something this uploader did not write is in its place: "
                              "remove it from the remote, then run this again (nothing local is changed)")
    return StorageError(f"{what}: {e.strerror}")


def _copy(src: BinaryIO, dst: BinaryIO | Destination, block_size: int | None, algorithm: str,
          on_bytes: OnBytes | None, abort: threading.Event | None, durable: bool = True,
          limit: int | None = None) -> tuple[int, str]:
    """Copy in large chunks, hashing on the way (each byte read once); fsync the destination when
    ``durable`` (an object of the remote; a download is not, see Remote.get_file). At most ``limit``
    bytes are read and written (a download stops one byte past the size it expects)."""
    digest = StreamDigest(block_size, algorithm)
    size = 0
    while chunk := src.read(CHUNK if limit is None else min(CHUNK, limit - size)):
        if abort is not None and abort.is_set():
            raise Aborted(f"copy to {dst.name} stopped on request")
        digest.update(memoryview(chunk))
        dst.write(chunk)
        size += len(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))
    dst.flush()
    if durable:
        os.fsync(dst.fileno())
    return size, digest.hexdigest()


def _set_digest(path: Path, digest: str) -> None:
    try:
        os.setxattr(path, XATTR_DIGEST, digest.encode())
    except OSError:
        logger.debug("no extended attributes on %s; a resumed upload will copy it again", path)


def _get_digest(path: Path) -> str | None:
    for name in (XATTR_DIGEST, XATTR_LEGACY):
        try:
            return os.getxattr(path, name).decode()
        except OSError:
            continue
    return None


class _Bounded:
    """A reader that ends after ``size`` bytes, and fails if the source ends sooner."""

    def __init__(self, raw: BinaryIO, size: int) -> None:
        self._raw, self._left = raw, size

    def read(self, n: int = -1) -> bytes:
        want = self._left if n < 0 else min(n, self._left)
        data = self._raw.read(want) if want else b""
        if want and not data:
            raise CorruptCheckpoint(f"{getattr(self._raw, 'name', 'a file')} is shorter than its listed size")
        self._left -= len(data)
        return data
