"""Checkpoints for tests, made without torch: random bytes, committed the way the job commits.

The job's tests reuse this: a checkpoint is a folder of files plus a manifest, whatever is inside.
"""
from __future__ import annotations

import ctypes
import io
import mmap
import os
import random
import json
import zipfile
from collections.abc import Callable, Mapping
from typing import Any
from pathlib import Path

from uploader.hashing import BLAKE3, BLOCK_SIZE, SHA256, StreamDigest, block_count, file_digest, sha256_file
from uploader.local import FINISHED_NAME, LocalCheckpoint, commit, staging_dir
from uploader.manifest import FORMAT_VERSION, FileEntry, Manifest
from uploader.remote import Remote
from uploader.sync import list_remote

# randbytes of one call overflows at 256 MiB; the benchmarks write 1 GiB files through here.
CHUNK = 64 * 1024 * 1024

# A few files, one of them in a sub-folder; sizes small enough to be quick everywhere.
SMALL_FILES: Mapping[str, int] = {"state.pt": 200_000, "optim.pt": 50_000, "rng/state.bin": 1_000, "empty": 0}
# Plus one file over the 5 MiB multipart threshold of s3server.fast_config: 3 parts up, 3 ranges down.
WITH_LARGE_FILE: Mapping[str, int] = {**SMALL_FILES, "big.bin": 11 * 1024 * 1024 + 123}


def make_checkpoint(
    folder: Path, step: int, files: Mapping[str, int] = SMALL_FILES, *, seed: int | None = None,
    block_size: int | None = BLOCK_SIZE, format_version: int = FORMAT_VERSION, meta: Mapping[str, object] | None = None,
) -> LocalCheckpoint:
    """Write ``files`` (relative path -> size) with random (incompressible) bytes into a staging folder
    and commit it. Any size works: the bytes are drawn and hashed a chunk at a time.

    ``block_size`` None with ``format_version=1`` is a checkpoint as the first release wrote it; format 2
    has sha256 block digests, format 3 (the default) BLAKE3 ones."""
    rng = random.Random(step if seed is None else seed)
    staging = staging_dir(folder, step)
    entries = []
    for relpath, size in files.items():
        path = staging / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        digest = StreamDigest(block_size, BLAKE3 if format_version >= 3 else SHA256)
        with open(path, "wb") as f:
            for start in range(0, size, CHUNK):
                data = rng.randbytes(min(CHUNK, size - start))
                f.write(data)
                digest.update(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        entries.append(FileEntry(path=relpath, size=size, digest=digest.hexdigest(), block_size=block_size,
                                 algorithm=digest.algorithm))
    manifest = Manifest(step=step, files=tuple(entries), timer={"epoch": 0, "batch": step}, format_version=format_version,
                        meta=dict(meta or {}))
    return commit(staging, manifest)


def reseal(ckpt_path: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Make a committed checkpoint verify again after its files were changed: every file's size and
    digest recomputed (same algorithm and blocks), then ``edit`` applied to the manifest's JSON. What a
    hand-made checkpoint looks like: sealed well, whatever it holds."""
    path = ckpt_path / "manifest.json"
    doc = json.loads(path.read_text())
    for entry in doc["files"]:
        algorithm = BLAKE3 if BLAKE3 in entry else SHA256
        block_size = entry.get("block_size")
        found = ckpt_path / entry["path"]
        entry["size"], entry[algorithm] = (sha256_file(found) if block_size is None
                                           else file_digest(found, block_size, algorithm=algorithm))
    if edit is not None:
        edit(doc)
    path.write_text(json.dumps(doc, indent=1, sort_keys=True))


def files_of(ckpt_path: Path) -> dict[str, bytes]:
    """Every file of a checkpoint folder (manifest included), by relative path: compare two folders with ==."""
    return {p.relative_to(ckpt_path).as_posix(): p.read_bytes() for p in sorted(ckpt_path.rglob("*")) if p.is_file()}


def checkpoints_of(folder: Path) -> dict[str, bytes]:
    """Like files_of, for a folder of checkpoints, without the FINISHED marker (each run rewrites it) and
    the run log (each start adds its life's record: uploader.runlog)."""
    return {k: v for k, v in files_of(folder).items() if k != FINISHED_NAME and not k.startswith("runlog/")}


def data_files_of(ckpt_path: Path) -> dict[str, bytes]:
    """Like files_of, without the manifest (which a pull re-serializes)."""
    return {k: v for k, v in files_of(ckpt_path).items() if k != "manifest.json"}


def zip_crc32s(data: bytes) -> set[int]:
    """The CRC-32 fields of a torch.save's records (a zip archive): all 0 when torch was told not to compute them."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {info.CRC for info in archive.infolist()}


def corrupt_file(path: Path) -> None:
    """Flip one byte, keeping the size: only a sha256 check notices."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def complete_steps(remote: Remote) -> list[int]:
    """Steps of the complete checkpoints on a remote, oldest first."""
    return [c.step for c in list_remote(remote) if c.complete]


def objects_of(remote: Remote, prefix: str = "") -> dict[str, bytes | None]:
    """Every object under ``prefix`` of a remote with its bytes: compare a remote before and after with ==."""
    return {o.key: remote.read_bytes(o.key) for o in remote.list(prefix)}


def cached_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache now (mincore(2) over a mapping of it)."""
    size = path.stat().st_size
    if size == 0:
        return 0
    pages = block_count(size, mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    with open(path, "rb") as f:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap failed")
        try:
            vector = ctypes.create_string_buffer(pages)
            if libc.mincore(address, size, vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            return sum(byte & 1 for byte in vector.raw)
        finally:
            libc.munmap(address, size)
