"""The manifest: the marker that makes a checkpoint count, written last.

A checkpoint is a folder of data files plus ``manifest.json``. The manifest lists every file with its
size and digest, the training position, and ``format_version`` so that old checkpoints stay loadable.
Readers treat a folder (or a remote prefix) without a manifest as incomplete and never use it.

Format versions (this build reads all three, and writes 3):

* 1: each file's ``sha256`` is the sha256 of its bytes.
* 2: a file may also give ``block_size``; its ``sha256`` is then the sha256 of its blocks' sha256
  digests (uploader.hashing), which transfers compute on all their threads at once. A format 2 entry
  without ``block_size`` means what it meant in format 1.
* 3: a file may give ``blake3`` instead of ``sha256``, always with ``block_size``: the BLAKE3 of its
  blocks' BLAKE3 digests (uploader.hashing). Entries of formats 1 and 2 stay valid in a format 3
  manifest (a pulled older checkpoint keeps its digests).

A manifest comes from a disk or a bucket, so it is untrusted input, and :meth:`Manifest.from_json` is
the one place that decides whether it is usable: at most MAX_MANIFEST_BYTES, strict JSON (no NaN or
Infinity), every field of the right type and range, ``block_size`` within [MIN_BLOCK_SIZE,
MAX_BLOCK_SIZE] (so verifying costs a bounded number of reads and bytes of memory per checkpoint
byte), a file layout that can exist on disk (no entry inside another, no escapes), and the payload the
job loads (``state.pt``; or, for ``meta.sharded``, the sharded layout below). Anything else is a
ManifestError: the checkpoint is skipped like a corrupt one, never a crash.

A sharded checkpoint (``--sharded``, written with torch.distributed.checkpoint by job.sharded) lists
exactly: ``dcp-metadata.json`` (DCP's metadata as JSON, never a pickle), ``replicated.pt`` (what
every rank shares besides the model and optimizer), one ``rank-RRRRR-of-WWWWW.pt`` per rank of the
run that wrote it (that rank's RNG and metric state), and DCP's data files ``__R_N.distcp`` of those
ranks. Which byte ranges of the data files hold what is the metadata's business, checked by the job
against this list when it loads (job.dcp_storage).
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from uploader.exceptions import CorruptCheckpoint, LocalAccessError, ManifestError, UnsupportedFormat
from uploader.hashing import ALGORITHMS, BLAKE3, SHA256, file_digest

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 3
SUPPORTED_FORMAT_VERSIONS = frozenset({1, 2, 3})
BLOCK_SIZE_SINCE = 2  # the first format_version whose entries may carry block_size
BLAKE3_SINCE = 3  # the first format_version whose entries may be BLAKE3 block digests
# Bounds on what a manifest may ask of a reader. A manifest of a 10 000-shard checkpoint is ~1.5 MB.
MAX_MANIFEST_BYTES = 8 * 1024 * 1024
MIN_BLOCK_SIZE = 64 * 1024  # at most 16 reads and ~1.2 KiB of block digests per MiB verified
MAX_BLOCK_SIZE = 64 * 1024 * 1024
MAX_FILE_SIZE = 2**50  # 1 PiB: any real file; keeps sizes far from float and int64 trouble
MAX_STEP = 10**12 - 1  # step folder names have 12 digits
MAX_PATH_BYTES = 1024  # in UTF-8
MAX_NAME_BYTES = 255  # NAME_MAX: the longest folder or file name Linux filesystems take
MAX_NODES = 100_000
MAX_DEPTH = 32  # folders in a file's path, and JSON nesting: far beyond what a checkpoint has
_SAVE_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII)  # one save's parts, across nodes
# The payload the job loads (job.checkpoint.STATE_FILE; job.sharded and job.dcp_storage for a sharded
# one): a checkpoint without it cannot be resumed, so it is refused here, with the other damage, and the
# previous one is used.
STATE_FILE = "state.pt"
DCP_METADATA = "dcp-metadata.json"
REPLICATED_FILE = "replicated.pt"
RANK_FILE_RE = re.compile(r"rank-([0-9]{5})-of-([0-9]{5})\.pt", re.ASCII)
# torch's FileSystemWriter names its data files __RANK_N.distcp
DCP_DATA_RE = re.compile(r"__(0|[1-9][0-9]{0,6})_(0|[1-9][0-9]{0,6})\.distcp", re.ASCII)
_DIGEST_RE = re.compile(r"[0-9a-f]{64}", re.ASCII)  # sha256 and BLAKE3 alike: 32 bytes in hex
_INT64 = 2**63


def safe_relpath(name: str) -> str:
    """Refuse paths that could escape the checkpoint folder on pull (absolute, ``..``, backslashes)."""
    if not isinstance(name, str) or not name or "\\" in name or any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise ManifestError(f"unsafe file name in manifest: {name!r}")
    try:
        encoded = name.encode()
    except UnicodeEncodeError:  # a lone surrogate from JSON's \ud800: no file can have that name
        raise ManifestError(f"unsafe file name in manifest: {name!r} (not valid Unicode)") from None
    if len(encoded) > MAX_PATH_BYTES:  # folder + this < PATH_MAX (4096)
        raise ManifestError(f"file name in manifest longer than {MAX_PATH_BYTES} bytes")
    p = PurePosixPath(name)
    if p.is_absolute() or any(part in ("..", ".", "") for part in name.split("/")):
        raise ManifestError(f"unsafe file name in manifest: {name!r} (absolute or '..' paths are refused)")
    if max(map(len, encoded.split(b"/"))) > MAX_NAME_BYTES:  # damage, not a full disk (ENAMETOOLONG)
        raise ManifestError(f"file name in manifest has a part longer than {MAX_NAME_BYTES} bytes, "
                            "which no Linux filesystem can hold")
    if name.count("/") >= MAX_DEPTH:  # the layout check looks at every folder of every path
        raise ManifestError(f"file name in manifest has more than {MAX_DEPTH} parts (its folders and itself)")
    if name.partition("/")[0] == MANIFEST_NAME:  # itself, or a folder where the manifest must go
        raise ManifestError(f"a manifest cannot list {name!r}: that is where the manifest goes")
    return name


@dataclass(frozen=True)
class FileEntry:
    """One data file of a checkpoint, as the manifest records it."""

    path: str
    size: int
    digest: str  # hex
    block_size: int | None = None  # None: a plain sha256 of the bytes (format 1); else a block digest
    # "sha256" or "blake3" (uploader.hashing); left empty: BLAKE3 for a block digest, else sha256
    algorithm: str = ""

    def __post_init__(self) -> None:
        if not self.algorithm:
            object.__setattr__(self, "algorithm", BLAKE3 if self.block_size is not None else SHA256)
        if self.algorithm not in ALGORITHMS or (self.block_size is None and self.algorithm != SHA256):
            raise ValueError(f"{self.path}: no {self.algorithm!r} digest without blocks")

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"path": self.path, "size": self.size, self.algorithm: self.digest}
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

    def __post_init__(self) -> None:
        if self.format_version < BLAKE3_SINCE and any(f.algorithm == BLAKE3 for f in self.files):
            raise ValueError(f"format_version {self.format_version} has no BLAKE3 digests")

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
        """Parse and validate untrusted bytes (see the module docstring); ManifestError if unusable,
        UnsupportedFormat if a newer spot-trainer wrote it."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            doc = strict_json(data, max_depth=MAX_DEPTH)
        except ValueError as e:
            raise ManifestError(f"manifest is not valid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ManifestError("manifest is not a JSON object")
        version = doc.get("format_version")
        if type(version) is not int or version not in SUPPORTED_FORMAT_VERSIONS:  # JSON true == 1; [] unhashable
            newer = type(version) is int and version > max(SUPPORTED_FORMAT_VERSIONS)
            raise (UnsupportedFormat if newer else ManifestError)(
                f"manifest format_version {_short(version)} is not supported (this build reads "
                f"{sorted(SUPPORTED_FORMAT_VERSIONS)}); upgrade spot-trainer"
            )
        if "files" not in doc or "step" not in doc:
            raise ManifestError(f"manifest is missing or has a malformed field: {'files' if 'files' not in doc else 'step'}")
        raw_files = doc["files"]
        if not isinstance(raw_files, list):
            raise ManifestError("manifest's files is not a list")
        files = tuple(_file_entry(f, version) for f in raw_files)
        meta = doc.get("meta", {})
        if not isinstance(meta, dict):
            raise ManifestError("manifest's meta is not an object")
        timer = doc.get("timer", {})
        if not isinstance(timer, dict):
            raise ManifestError("manifest's timer is not an object")
        created = finite_number(doc.get("created", 0.0))
        if created is None:
            raise ManifestError(f"manifest's created is not a number: {_short(doc.get('created'))}")
        manifest = cls(
            step=_integer(doc["step"], "step", 0, MAX_STEP),
            files=files,
            timer={_key(k): _integer(v, f"timer.{_key(k)}", -_INT64, _INT64 - 1) for k, v in timer.items()},
            meta=meta,
            created=created,
            format_version=version,
        )
        _check_layout(manifest)
        return manifest

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        """The manifest of a local checkpoint folder: a regular file (never a link), size-capped."""
        path = folder / MANIFEST_NAME
        try:
            with open_regular(path) as f:
                return cls.from_json(f.read(MAX_MANIFEST_BYTES + 1))
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{folder}: no {MANIFEST_NAME}, the checkpoint is incomplete") from None
        except OSError as e:
            raise _unreadable(f"{folder}: cannot read its {MANIFEST_NAME}", e) from None

    def for_step(self, step: int) -> Manifest:
        """This manifest, if it is for ``step`` (the step its checkpoint's name says); ManifestError if not. A
        checkpoint whose manifest is another step's (copied, or hand-made) is not that step's checkpoint:
        resuming it, counting it in retention or uploading it under its name would all mix two steps."""
        if self.step != step:
            raise ManifestError(f"its manifest is for step {self.step}")
        return self

    def whole_for_step(self, step: int) -> Manifest:
        """:meth:`for_step`, for the manifest at a whole checkpoint's key in a bucket (``step-…/manifest.json``):
        one node's part there (its ``meta.node``) is damage, never a checkpoint. A part's payload is checked
        only on the whole it joins, so one with no files at all was pulled as complete, failed every start
        (``state.pt is missing``) and was counted by retention, which deleted good checkpoints below it."""
        if node_part(self.for_step(step)) is not None:
            raise ManifestError("its manifest is one node's part of a multi-node checkpoint (meta.node), not a "
                                "whole checkpoint")
        return self

    def verify(self, folder: Path) -> None:
        """Check every listed file's size and digest; raise CorruptCheckpoint on the first mismatch.

        Each file must be a regular file inside ``folder``, reached without symbolic links: a link
        (to /dev/zero, or to another run's file) is damage, never followed.
        """
        for entry in self.files:
            path = folder / entry.path
            try:
                st = lstat_inside(folder, entry.path)
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{folder}: {entry.path} is missing") from None
            except OSError as e:
                raise _unreadable(f"{folder}: {entry.path} cannot be read", e) from None
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpoint(f"{folder}: {entry.path} is not a regular file (a link, folder or device)")
            if st.st_size != entry.size:
                raise CorruptCheckpoint(
                    f"{folder}: {entry.path} has {st.st_size} bytes, the manifest says {entry.size} (truncated?)"
                )
            try:
                size, digest = file_digest(path, entry.block_size, algorithm=entry.algorithm)
            except OSError as e:
                raise _unreadable(f"{folder}: {entry.path} cannot be read", e) from None
            if size != entry.size or digest != entry.digest:
                raise CorruptCheckpoint(f"{folder}: {entry.path} fails its {entry.algorithm} check")


def _unreadable(what: str, e: OSError) -> CorruptCheckpoint | LocalAccessError:
    """A checkpoint's file this process may not read is not damaged: set aside as corrupt (as before), a good
    checkpoint was lost to a permission (exit 3 instead, and it is left as it is). Any other failure to
    read it (EIO, a folder in its place) is damage."""
    if isinstance(e, PermissionError):
        return LocalAccessError(f"{what} ({e.strerror or e}): run as a user that may read the checkpoint (the "
                                "uid that wrote it, or a shared group and fsGroup); it is left as it is")
    return CorruptCheckpoint(f"{what} ({e.strerror or e})")


@contextlib.contextmanager
def open_regular(path: Path) -> Iterator[BinaryIO]:
    """``open(path, "rb")`` that refuses a symbolic link (O_NOFOLLOW) and anything but a regular file,
    and never blocks on a FIFO (O_NONBLOCK): reading a planted /dev/zero or pipe must not run forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a folder, device or pipe)", str(path))
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def lstat_inside(folder: Path, relpath: str) -> os.stat_result:
    """lstat of ``folder/relpath``, refusing (ELOOP) any symbolic link on the way below ``folder``."""
    current = folder
    parts = relpath.split("/")
    for i, part in enumerate(parts):
        current = current / part
        st = os.lstat(current)
        if stat.S_ISLNK(st.st_mode):
            raise OSError(errno.ELOOP, "a symbolic link, refused", str(current))
        if i < len(parts) - 1 and not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", str(current))
    return st


def strict_json(data: bytes | str, max_depth: int | None = None) -> Any:
    """JSON from an untrusted file: no NaN or Infinity (nor a number that overflows to it), and nesting
    too deep for the parser is a ValueError like any other malformed document, never a RecursionError.
    Where the parser gives up depends on how deep the caller's stack is, so the same file could be good
    in one thread and bad in another; ``max_depth`` refuses nesting beyond a fixed depth first, the same
    everywhere."""
    try:
        if max_depth is not None:  # UTF-8 only (json.loads would take UTF-16 too, whose bytes hide brackets)
            raw, data = (data, data.decode("utf-8")) if isinstance(data, bytes) else \
                (data.encode("utf-8", "surrogatepass"), data)
            if _nested_beyond(raw, max_depth):
                raise ValueError(f"nested more than {max_depth} levels deep")
        return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except UnicodeDecodeError as e:
        raise ValueError(str(e)) from None
    except RecursionError:
        raise ValueError("nested too deeply") from None


# Possessive, and a string left open runs to the end: no backtracking, linear in the worst case (a
# backtracking one took seconds for 32 KB of '"' and '\\"' pairs, hours for 8 MB).
_JSON_STRING_RE = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_EMPTY_PAIR_RE = re.compile(rb"\[\]|\{\}")


def _nested_beyond(data: bytes, depth: int) -> bool:
    """Whether the brackets outside strings nest deeper than ``depth``: each pass of the regular
    expression (C, linear) removes the innermost pairs, one level, without recursion. Without a
    backslash no string holds a quote, so the text outside strings is every other piece between quotes
    (a tenth of a 10,000-file manifest's parse, against a third with the regular expression)."""
    outside = b"".join(data.split(b'"')[0::2]) if b"\\" not in data else _JSON_STRING_RE.sub(b"", data)
    brackets = outside.translate(None, _NOT_BRACKETS)
    for _ in range(depth):
        if not brackets:
            return False
        brackets = _EMPTY_PAIR_RE.sub(b"", brackets)
    return _EMPTY_PAIR_RE.search(brackets) is not None  # else unbalanced: json.loads says what is wrong


def finite_number(value: Any) -> float | None:
    """A JSON number as a finite float; None for anything else. JSON's integers have no bound: 10**400
    raised OverflowError in math.isfinite (a traceback, exit 1, for a damaged manifest; ``job report`` for a
    ledger record)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _finite_float(text: str) -> float:
    """JSON's 1e400 is Python's inf: as unusable as the Infinity that _refuse_constant refuses."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is beyond what a number can hold")
    return value


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _key(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


def _integer(value: Any, what: str, low: int, high: int) -> int:
    """A JSON integer in [low, high]: not a bool, a float or a string that looks like one."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ManifestError(f"manifest's {what} is not an integer in [{low}, {high}]: {_short(value)}")
    return value


def _file_entry(doc: Any, version: int) -> FileEntry:
    if not isinstance(doc, dict):
        raise ManifestError(f"manifest lists a file entry that is not an object: {_short(doc)}")
    for key in ("path", "size"):
        if key not in doc:
            raise ManifestError(f"manifest is missing or has a malformed field: a file entry has no {key!r}")
    algorithms = [a for a in ALGORITHMS if a in doc]
    if version < BLAKE3_SINCE and BLAKE3 in algorithms:
        raise ManifestError(f"manifest format_version {version} has no blake3 digests; the manifest is damaged")
    if len(algorithms) != 1:
        raise ManifestError("manifest is missing or has a malformed field: a file entry needs one digest "
                            f"({' or '.join(ALGORITHMS)}), it has {len(algorithms)}")
    algorithm = algorithms[0]
    digest = doc[algorithm]
    if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
        raise ManifestError(f"manifest lists a malformed {algorithm}: {_short(digest)}")
    block_size = _block_size(doc.get("block_size"), version)
    if algorithm == BLAKE3 and block_size is None:
        raise ManifestError("manifest lists a blake3 digest without its block_size; the manifest is damaged")
    return FileEntry(path=safe_relpath(doc["path"]), size=_integer(doc["size"], "file size", 0, MAX_FILE_SIZE),
                     digest=digest, block_size=block_size, algorithm=algorithm)


def _block_size(value: Any, version: int) -> int | None:
    if value is None:
        return None
    if version < BLOCK_SIZE_SINCE:
        raise ManifestError(f"manifest format_version {version} has no block_size; the manifest is damaged")
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_BLOCK_SIZE <= value <= MAX_BLOCK_SIZE:
        raise ManifestError(f"manifest lists a malformed block_size: {_short(value)} (accepted: "
                            f"{MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE} bytes)")
    return value


def node_part(manifest: Manifest) -> tuple[int, int] | None:
    """(node, nodes) of one node's part of a multi-node checkpoint (its ``meta.node`` and ``meta.nodes``;
    uploader.sync commits the whole once every part is uploaded), None for a whole checkpoint.
    ManifestError when the fields are malformed."""
    if "node" not in manifest.meta:
        return None
    node, nodes = manifest.meta.get("node"), manifest.meta.get("nodes")
    for value in (node, nodes):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ManifestError(f"manifest's meta.node/meta.nodes are not integers: {_short(node)}/{_short(nodes)}")
    if not 0 <= node < nodes <= MAX_NODES:
        raise ManifestError(f"manifest's meta.node {node} is not one of {nodes} nodes (at most {MAX_NODES})")
    save_id = manifest.meta.get("save_id")
    if not isinstance(save_id, str) or not _SAVE_ID_RE.fullmatch(save_id):
        raise ManifestError(f"manifest of a node's part has no valid meta.save_id: {_short(save_id)}")
    return node, nodes


def _check_layout(manifest: Manifest) -> None:
    """Files that can all exist in one folder, and the payload the job loads."""
    paths = [f.path for f in manifest.files]
    listed = set(paths)
    if len(listed) != len(paths):
        raise ManifestError("manifest lists a file twice")
    clash = sorted(folder for p in paths for folder in _folders(p) if folder in listed)
    if clash:
        raise ManifestError(f"manifest lists {clash[0]!r} both as a file and as a folder of other files")
    sharded = manifest.meta.get("sharded", False)
    if not isinstance(sharded, bool):
        raise ManifestError(f"manifest's meta.sharded is not true or false: {_short(sharded)}")
    if node_part(manifest) is not None:
        return  # one node's part of a multi-node checkpoint: the payload is checked on the whole
    if not sharded:
        if STATE_FILE not in paths:
            raise ManifestError(f"manifest does not list {STATE_FILE}, the state the job loads")
        return
    _check_sharded_layout(paths)


def _folders(path: str) -> Iterator[str]:
    """The folders ``path`` is in, one at a time (a set of them all would take memory in the square of
    the paths' depth)."""
    at = path.find("/")
    while at != -1:
        yield path[:at]
        at = path.find("/", at + 1)


def _check_sharded_layout(paths: list[str]) -> None:
    """The sharded payload, exactly: the metadata, the replicated state, one file per rank of one run,
    and DCP data files of those ranks; nothing else (module docstring)."""
    ranks = [m for m in (RANK_FILE_RE.fullmatch(p) for p in paths) if m is not None]
    worlds = {int(m.group(2)) for m in ranks}
    if len(worlds) != 1 or sorted(int(m.group(1)) for m in ranks) != list(range(next(iter(worlds)))):
        raise ManifestError("manifest of a sharded checkpoint does not list exactly one rank-RRRRR-of-WWWWW.pt "
                            "per rank")
    world = next(iter(worlds))
    for name in (DCP_METADATA, REPLICATED_FILE):
        if name not in paths:
            raise ManifestError(f"manifest of a sharded checkpoint does not list {name}")
    data = [m for m in (DCP_DATA_RE.fullmatch(p) for p in paths) if m is not None]
    if not data:
        raise ManifestError("manifest of a sharded checkpoint lists no data file (__R_N.distcp)")
    if any(int(m.group(1)) >= world for m in data):
        raise ManifestError(f"manifest of a sharded checkpoint lists a data file of a rank beyond its {world} ranks")
    extra = sorted(set(paths) - {m.string for m in ranks + data} - {DCP_METADATA, REPLICATED_FILE})
    if extra:
        raise ManifestError(f"manifest of a sharded checkpoint lists a file that is not part of one: {_short(extra[0])}")
