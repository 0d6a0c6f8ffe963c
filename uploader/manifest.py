"""The manifest: the marker that makes a checkpoint count, written last.

A checkpoint is a folder of data files plus ``manifest.json``. The manifest lists every file with its
size and digest, the training position, and ``format_version`` so that old checkpoints stay loadable.
Readers treat a folder (or a remote prefix) without a manifest as incomplete and never use it.

Format versions (this build reads both, and writes 2):

* 1: each file's ``sha256`` is the sha256 of its bytes.
* 2: a file may also give ``block_size``; its ``sha256`` is then the sha256 of its blocks' sha256
  digests (uploader.hashing), which transfers compute on all their threads at once. A format 2 entry
  without ``block_size`` means what it meant in format 1.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from uploader.exceptions import CorruptCheckpoint, ManifestError, UnsupportedFormat
from uploader.hashing import file_digest

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 2
SUPPORTED_FORMAT_VERSIONS = frozenset({1, 2})
BLOCK_SIZE_SINCE = 2  # the first format_version whose entries may carry block_size


def safe_relpath(name: str) -> str:
    """Refuse paths that could escape the checkpoint folder on pull (absolute, ``..``, backslashes)."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        raise ManifestError(f"unsafe file name in manifest: {name!r}")
    p = PurePosixPath(name)
    if p.is_absolute() or any(part in ("..", ".", "") for part in name.split("/")):
        raise ManifestError(f"unsafe file name in manifest: {name!r} (absolute or '..' paths are refused)")
    if name == MANIFEST_NAME:
        raise ManifestError("a manifest cannot list itself")
    return name


@dataclass(frozen=True)
class FileEntry:
    """One data file of a checkpoint, as the manifest records it."""

    path: str
    size: int
    sha256: str
    block_size: int | None = None  # None: a plain sha256 of the bytes; else see uploader.hashing

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "size": self.size, "sha256": self.sha256}
        if self.block_size is not None:
            doc["block_size"] = self.block_size
        return doc


@dataclass(frozen=True)
class Manifest:
    """The parsed, validated content of ``manifest.json``."""

    step: int
    files: tuple[FileEntry, ...]
    timer: dict[str, int] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    format_version: int = FORMAT_VERSION

    @property
    def total_size(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        doc = {
            "format_version": self.format_version,
            "step": self.step,
            "timer": self.timer,
            "created": self.created,
            "files": [f.to_doc() for f in self.files],
            "meta": self.meta,
        }
        return json.dumps(doc, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes | str) -> Manifest:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError) as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ManifestError("manifest is not a JSON object")
        version = doc.get("format_version")
        if isinstance(version, bool) or version not in SUPPORTED_FORMAT_VERSIONS:  # JSON true == 1 in Python
            newer = type(version) is int and version > max(SUPPORTED_FORMAT_VERSIONS)
            raise (UnsupportedFormat if newer else ManifestError)(
                f"manifest format_version {version!r} is not supported (this build reads "
                f"{sorted(SUPPORTED_FORMAT_VERSIONS)}); upgrade spot-trainer"
            )
        try:
            files = tuple(
                FileEntry(path=safe_relpath(f["path"]), size=int(f["size"]), sha256=str(f["sha256"]),
                          block_size=_block_size(f.get("block_size"), version))
                for f in doc["files"]
            )
            step = int(doc["step"])
            timer = {str(k): int(v) for k, v in dict(doc.get("timer", {})).items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"manifest is missing or has a malformed field: {e}") from None
        if len({f.path for f in files}) != len(files):
            raise ManifestError("manifest lists a file twice")
        if any(f.size < 0 for f in files):
            raise ManifestError("manifest lists a negative file size")
        meta = doc.get("meta", {})
        return cls(
            step=step,
            files=files,
            timer=timer,
            meta=meta if isinstance(meta, dict) else {},
            created=float(doc.get("created", 0.0)),
            format_version=version,
        )

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = folder / MANIFEST_NAME
        try:
            return cls.from_json(path.read_bytes())
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{folder}: no {MANIFEST_NAME}, the checkpoint is incomplete") from None

    def verify(self, folder: Path) -> None:
        """Check every listed file's size and sha256; raise CorruptCheckpoint on the first mismatch."""
        for entry in self.files:
            path = folder / entry.path
            try:
                actual = path.stat().st_size
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{folder}: {entry.path} is missing") from None
            if actual != entry.size:
                raise CorruptCheckpoint(
                    f"{folder}: {entry.path} has {actual} bytes, the manifest says {entry.size} (truncated?)"
                )
            _, digest = file_digest(path, entry.block_size)
            if digest != entry.sha256:
                raise CorruptCheckpoint(f"{folder}: {entry.path} fails its sha256 check")


def _block_size(value: Any, version: int) -> int | None:
    if value is None:
        return None
    if version < BLOCK_SIZE_SINCE:
        raise ManifestError(f"manifest format_version {version} has no block_size; the manifest is damaged")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ManifestError(f"manifest lists a malformed block_size: {value!r}")
    return value
