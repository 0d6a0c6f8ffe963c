"""torch.distributed.checkpoint's storage, without pickle: metadata as JSON, every read weights-only.

DCP decides what is written and read: its planners flatten the state dict, write replicated items once,
and reshard DTensors between any numbers of ranks. A storage layer only says where the bytes go. The
stock FileSystemWriter/Reader keep DCP's metadata in ``.metadata``, a pickle that the reader unpickles
as code, and the stock load planner unpickles non-tensor items without restriction. Here instead:

* :class:`JsonMetadataWriter` is the stock writer (one ``__R_N.distcp`` file per rank, fsynced) whose
  metadata file is ``dcp-metadata.json`` (:func:`encode_metadata`): for each item its flattened key,
  its path in the nested state dict, and for a tensor its dtype, size and chunks; each chunk, and each
  non-tensor item, with the file, offset and length of its bytes. A save is split where its
  collectives end: :func:`plan_save` (collective: DCP's planning, in the training thread), then
  :meth:`PlannedSave.write` (no collective, any thread: this rank's files) and, once the caller has
  gathered every rank's results, :meth:`PlannedSave.finish` (rank 0: the metadata).
* :func:`read_metadata` parses that JSON as untrusted input (:func:`decode_metadata`): strict types
  and bounds, a known dtype, chunks that cover their tensor exactly once, byte ranges inside the data
  files the manifest lists (and so hashed), never overlapping and large enough for their chunk (what a
  load allocates is bounded by the bytes on disk). Anything else is a CheckpointLoadError.
* :class:`SafeReader` reads each byte range and loads it with ``torch.load(weights_only=True)``; a
  tensor must have exactly its chunk's dtype and shape. :class:`SafeLoadPlanner` is DCP's
  DefaultLoadPlanner with non-tensor items loaded weights-only as well, and SafeReader works with no
  other planner.
"""
from __future__ import annotations

import io
import json
import math
import os
import queue
import warnings
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter, filesystem
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, WriteResult
from torch.futures import Future

from job import distributed
from job.exceptions import CheckpointLoadError, CheckpointWriteError
from job.safe_load import first_line, load_weights_only
from state.display import clip
from uploader.hashing import BLOCK_SIZE, digest_bytes
from uploader.manifest import DCP_DATA_RE, DCP_METADATA, FileEntry, Manifest, open_regular, strict_json

FORMAT = "spot-trainer/dcp-metadata"
FORMAT_VERSION = 1
# Bounds on what a metadata file may ask of a reader, far above any real checkpoint. What a load
# allocates is bounded by the bytes of the data files besides (decode_metadata).
# The memory that parsing the JSON takes, as _json_cost estimates it (never below it): ~2,100 bytes
# per chunk of this module's encoding, whose Python objects take ~650, so some 2,000,000 chunks of all
# tensors together (a 7B model's weights and Adam moments on 2,000 ranks), in ~190 MB of JSON; a
# hostile file, at most about 4 GiB while it is parsed (512 MiB of JSON took up to 13 GiB before).
# encode_metadata refuses to write what a reader would refuse.
MAX_JSON_COST = 4 * 1024 * 1024 * 1024
MAX_METADATA_BYTES = 256 * 1024 * 1024  # room for long keys besides
MAX_ITEMS = 10_000_000
MAX_CHUNKS = 1_000_000  # of one tensor
MAX_DIMS = 64
MAX_DIM = 2**48
MAX_PATH_DEPTH = 64
MAX_KEY_CHARS = 4096
_DTYPE_NAMES = ("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16",
                "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
                "float8_e4m3fnuz", "float8_e5m2fnuz")
DTYPES: dict[str, torch.dtype] = {n: getattr(torch, n) for n in _DTYPE_NAMES if isinstance(getattr(torch, n, None), torch.dtype)}
_NAME_OF = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Slice:
    """Where one item's bytes are: ``length`` bytes of data file ``file`` from ``offset`` (a torch.save
    of the item); for a tensor chunk, also the chunk's shape."""

    file: str
    offset: int
    length: int
    sizes: tuple[int, ...] | None = None


# -- writing ------------------------------------------------------------------------------------------


class JsonMetadataWriter(FileSystemWriter):
    """DCP's FileSystemWriter (its data files, fsynced) with the metadata written as JSON.

    After a save, :meth:`data_files` names the files this rank wrote, and on the coordinator (rank 0)
    ``metadata_entry`` describes the metadata file for the manifest.
    """

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True)
        self.folder = folder
        self.prefix: str | None = None
        self.metadata_entry: FileEntry | None = None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """DCP's own file writing, with this rank's shards in ``__R_0.distcp`` and everything else it was
        given (replicated tensors such as the optimizers' step counts, and non-tensor items) in
        ``__R_1.distcp``: a rank resuming on another node reads the small file of another rank, never
        its large one, so each node downloads what its own ranks hold (job.node_pull)."""
        self.prefix = plan.storage_data.prefix  # "__R_": every file this rank writes starts with it
        shards = [item for item in plan.items if item.type == WriteItemType.SHARD]
        others = [item for item in plan.items if item.type != WriteItemType.SHARD]
        files: queue.Queue[tuple[str, str, list[Any]]] = queue.Queue()
        for i, bucket in enumerate([b for b in (shards, others) if b] or [[]]):  # an empty rank: one empty file
            name = f"{self.prefix}{i}{filesystem.DEFAULT_SUFFIX}"
            files.put((self.fs.concat_path(self.path, name), name, bucket))
        return self._write_data(planner, files)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for per_rank in results for r in per_rank}
        metadata.version = metadata.version or getattr(filesystem, "CURRENT_DCP_VERSION", None)
        data = encode_metadata(metadata)
        with open(self.folder / DCP_METADATA, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        self.metadata_entry = FileEntry(DCP_METADATA, len(data), digest_bytes(data, BLOCK_SIZE), BLOCK_SIZE)

    def data_files(self) -> list[str]:
        """The data files this rank wrote (an empty one too: it is in the folder all the same)."""
        if self.prefix is None:
            return []
        return sorted(p.name for p in self.folder.iterdir()
                      if p.name.startswith(self.prefix) and DCP_DATA_RE.fullmatch(p.name))


def encode_metadata(metadata: Metadata) -> bytes:
    """DCP's Metadata as JSON (module docstring): nothing in it can run code when it is read back."""
    mappings = metadata.planner_data or {}
    items: list[dict[str, Any]] = []
    for key, entry in sorted(metadata.state_dict_metadata.items()):
        path = list(mappings.get(key, (key,)))
        if isinstance(entry, TensorStorageMetadata):
            dtype = _NAME_OF.get(entry.properties.dtype)
            if dtype is None:
                raise ValueError(f"{key}: tensors of {entry.properties.dtype} cannot be checkpointed sharded")
            chunks = [{"offsets": list(c.offsets), "sizes": list(c.sizes),
                       **_where(metadata.storage_data[MetadataIndex(key, c.offsets)])} for c in entry.chunks]
            items.append({"key": key, "path": path, "kind": "tensor", "dtype": dtype, "size": list(entry.size),
                          "chunks": chunks})
        else:
            items.append({"key": key, "path": path, "kind": "bytes", **_where(metadata.storage_data[MetadataIndex(key)])})
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "dcp_version": metadata.version or "", "items": items}
    data = json.dumps(doc, separators=(",", ":")).encode()
    if len(data) > MAX_METADATA_BYTES or _json_cost(data) > MAX_JSON_COST:  # caught here, not at the resume
        chunks = sum(len(item.get("chunks", ())) for item in items)
        raise ValueError(f"the checkpoint's layout ({chunks} chunks, {len(data) >> 20} MiB of metadata) is more "
                         "than its reader accepts (job.dcp_storage.MAX_JSON_COST): shard over fewer ranks")
    return data


def _where(info: Any) -> dict[str, Any]:
    """The stock writer's storage record (relative path, offset, length) as JSON fields."""
    if getattr(info, "transform_descriptors", None):
        raise ValueError("DCP stream transforms are not supported")
    return {"file": str(info.relative_path), "offset": int(info.offset), "length": int(info.length)}


@dataclass
class PlannedSave:
    """One rank's part of a DCP save, planned (:func:`plan_save`) and not yet written.

    What is left needs no collective: :meth:`write` (every rank, any thread) writes this rank's files
    from the state dict the plan was made of, and :meth:`finish` (the coordinator, rank 0, once every
    rank's write results are in) writes the metadata. torch's dcp.save does the same steps with the
    exchanges built in; here the caller exchanges the results, so the writes can run in a background
    thread while the training thread alone runs collectives (job.checkpoint).
    """

    writer: JsonMetadataWriter
    planner: DefaultSavePlanner
    plan: SavePlan
    metadata: Metadata | None  # the global plan's metadata, on the coordinator

    def write(self) -> list[WriteResult]:
        """This rank's data files, fsynced; an OSError as itself (the caller says what to do about a full disk)."""
        done = self.writer.write_data(self.plan, self.planner)
        done.wait()
        return done.value()

    def finish(self, results: list[list[WriteResult]]) -> FileEntry:
        """Coordinator: the metadata of every rank's ``results`` (in rank order), as JSON; its manifest entry."""
        assert self.metadata is not None, "finish runs on the coordinator"
        self.writer.finish(self.metadata, results)
        assert self.writer.metadata_entry is not None
        return self.writer.metadata_entry


def plan_save(tree: dict[str, Any], folder: Path, failure: str | None = None) -> PlannedSave:
    """Collective: DCP's planning of a save of ``tree`` (of a DTensor, this rank's shard) into ``folder``,
    the steps of torch's state_dict_saver._save_state_dict before its writes, with DCP's own
    DefaultSavePlanner: every rank's local plan, the coordinator's global plan (replicated items
    written once), each rank's final plan. ``tree`` must not change until :meth:`PlannedSave.write`
    has read it. A failure on any rank is a CheckpointWriteError on every rank, ``failure`` too (this
    rank's own, before the plan: every rank still takes part in the exchange)."""
    rank = distributed.rank()
    writer, planner = JsonMetadataWriter(folder), DefaultSavePlanner()
    local: SavePlan | str
    if failure is not None:
        local = failure
    else:
        try:
            planner.set_up_planner(tree, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            local = writer.prepare_local_plan(planner.create_local_plan())
        except Exception as e:  # noqa: BLE001 - every rank must reach the exchange below, or the others wait forever
            local = f"rank {rank}: {first_line(e, 300)}"
    gathered = distributed.gather_to_first(local)
    metadata: Metadata | None = None
    central: list[SavePlan | str] | None = None
    if gathered is not None:  # the coordinator
        failed = [p for p in gathered if isinstance(p, str)]
        if failed:
            central = ["; ".join(failed)] * len(gathered)
        else:
            try:
                plans, metadata = planner.create_global_plan(gathered)
                central = list(writer.prepare_global_plan(plans))
            except Exception as e:  # noqa: BLE001 - handed to every rank
                central = [f"rank {rank}: {first_line(e, 300)}"] * len(gathered)
    mine = distributed.scatter_from_first(central)
    if isinstance(mine, str):
        raise CheckpointWriteError(f"cannot write a sharded checkpoint to {folder}: {mine}")
    return PlannedSave(writer, planner, planner.finish_plan(mine), metadata)


# -- reading ------------------------------------------------------------------------------------------


def read_metadata(folder: Path, manifest: Manifest) -> Metadata:
    """The validated metadata of the sharded checkpoint in ``folder`` (a CheckpointLoadError if unusable)."""
    try:
        with open_regular(folder / DCP_METADATA) as f:
            data = f.read(MAX_METADATA_BYTES + 1)
    except OSError as e:
        raise CheckpointLoadError(f"{folder}: cannot read {DCP_METADATA} ({e.strerror or e})") from None
    return decode_metadata(data, {f.path: f.size for f in manifest.files}, str(folder))


def decode_metadata(data: bytes, files: Mapping[str, int], where: str) -> Metadata:
    """Parse and validate untrusted metadata (module docstring). ``files``: the checkpoint's files and
    their sizes, from its manifest; only its DCP data files may hold items."""
    try:
        return _Decoder(files).decode(data)
    except _Invalid as e:
        raise CheckpointLoadError(f"{where}: {DCP_METADATA} is damaged or hostile ({e}); the checkpoint cannot be "
                                  "loaded") from None


class _Invalid(Exception):
    pass


class _Decoder:
    def __init__(self, files: Mapping[str, int]) -> None:
        self.files = {name: size for name, size in files.items() if DCP_DATA_RE.fullmatch(name)}
        self.ranges: dict[str, list[tuple[int, int, str]]] = {}
        self.item_count = 0

    def decode(self, data: bytes) -> Metadata:
        if len(data) > MAX_METADATA_BYTES:
            raise _Invalid(f"larger than {MAX_METADATA_BYTES} bytes")
        cost = _json_cost(data)
        if cost > MAX_JSON_COST:
            raise _Invalid(f"its JSON would take about {cost >> 20} MiB of memory to parse, more than the "
                           f"{MAX_JSON_COST >> 20} MiB allowed (some 2,000,000 chunks)")
        try:
            doc = strict_json(data)
        except ValueError as e:
            raise _Invalid(f"not JSON: {clip(str(e), 120)}") from None
        _fields(doc, "the document", {"format", "format_version", "dcp_version", "items"})
        if doc["format"] != FORMAT or type(doc["format_version"]) is not int or doc["format_version"] != FORMAT_VERSION:
            raise _Invalid(f"not {FORMAT} version {FORMAT_VERSION}: {_short(doc['format'])} {_short(doc['format_version'])}")
        version = doc["dcp_version"]
        if not isinstance(version, str) or len(version) > 64:
            raise _Invalid(f"dcp_version is not a short string: {_short(version)}")
        items = doc["items"]
        if not isinstance(items, list) or not 0 < len(items) <= MAX_ITEMS:
            raise _Invalid(f"items is not a list of 1 to {MAX_ITEMS} items")
        self.item_count = len(items)
        state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        paths: dict[str, tuple[str | int, ...]] = {}
        storage: dict[MetadataIndex, Slice] = {}
        for item in items:
            key, path, entry = self._item(item, storage)
            if key in state:
                raise _Invalid(f"{_short(key)} is listed twice")
            state[key], paths[key] = entry, path
        _check_paths(paths)
        self._check_ranges()
        return Metadata(state_dict_metadata=state, planner_data=paths, storage_data=storage,
                        storage_meta=StorageMeta(), version=version or None)

    def _item(self, item: Any, storage: dict[MetadataIndex, Slice]) -> tuple[str, tuple[str | int, ...],
                                                                                TensorStorageMetadata | BytesStorageMetadata]:
        if not isinstance(item, dict) or item.get("kind") not in ("tensor", "bytes"):
            raise _Invalid(f"an item is not an object of kind tensor or bytes: {_short(item)}")
        if item["kind"] == "bytes":
            _fields(item, "a bytes item", {"key", "path", "kind", "file", "offset", "length"})
        else:
            _fields(item, "a tensor item", {"key", "path", "kind", "dtype", "size", "chunks"})
        key = item["key"]
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise _Invalid(f"an item's key is not a string of 1 to {MAX_KEY_CHARS} characters: {_short(key)}")
        path = self._path(item["path"], key)
        if item["kind"] == "bytes":
            storage[MetadataIndex(key)] = self._slice(item, key)
            return key, path, BytesStorageMetadata()
        dtype = DTYPES.get(item["dtype"]) if isinstance(item["dtype"], str) else None
        if dtype is None:
            raise _Invalid(f"{_short(key)}: unknown dtype {_short(item['dtype'])}")
        size = _dims(item["size"], f"{key}'s size")
        chunks = item["chunks"]
        if not isinstance(chunks, list) or not 0 < len(chunks) <= MAX_CHUNKS:
            raise _Invalid(f"{_short(key)}: chunks is not a list of 1 to {MAX_CHUNKS} chunks")
        parsed: list[ChunkStorageMetadata] = []
        for chunk in chunks:
            _fields(chunk, f"a chunk of {key}", {"offsets", "sizes", "file", "offset", "length"})
            offsets, sizes = _dims(chunk["offsets"], f"{key}'s chunk offsets"), _dims(chunk["sizes"], f"{key}'s chunk sizes")
            if len(offsets) != len(size) or len(sizes) != len(size) or any(
                    o + s > d for o, s, d in zip(offsets, sizes, size)):
                raise _Invalid(f"{_short(key)}: a chunk {offsets}+{sizes} is not inside the tensor's size {size}")
            where = self._slice(chunk, key, sizes)
            if math.prod(sizes) * dtype.itemsize > where.length:
                raise _Invalid(f"{_short(key)}: a chunk of {sizes} {item['dtype']} is stored in fewer bytes ({where.length})")
            index = MetadataIndex(key, offsets)
            if index in storage:
                raise _Invalid(f"{_short(key)}: two chunks at {offsets}")
            storage[index] = where
            parsed.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        _check_cover(key, size, parsed)
        return key, path, TensorStorageMetadata(properties=TensorProperties(dtype=dtype), size=torch.Size(size),
                                                chunks=parsed)

    def _path(self, value: Any, key: str) -> tuple[str | int, ...]:
        """The item's place in the nested state dict: keys, and list indices below the number of items
        (set_element grows a list up to its index)."""
        if not isinstance(value, list) or not 0 < len(value) <= MAX_PATH_DEPTH or not isinstance(value[0], str):
            raise _Invalid(f"{_short(key)}: path is not a list of 1 to {MAX_PATH_DEPTH} keys starting with a string")
        for part in value:
            if isinstance(part, str):
                if len(part) > MAX_KEY_CHARS:
                    raise _Invalid(f"{_short(key)}: a path key is longer than {MAX_KEY_CHARS} characters")
            elif type(part) is not int or not 0 <= part < self.item_count:
                raise _Invalid(f"{_short(key)}: path element {_short(part)} is neither a key nor a list index")
        if ".".join(map(str, value)) != key:
            raise _Invalid(f"{_short(key)}: path {_short(value)} does not spell the key")
        return tuple(value)

    def _slice(self, doc: dict[str, Any], key: str, sizes: list[int] | None = None) -> Slice:
        name, offset, length = doc["file"], doc["offset"], doc["length"]
        if not isinstance(name, str) or name not in self.files:
            raise _Invalid(f"{_short(key)}: file {_short(name)} is not a data file of this checkpoint's manifest")
        for what, n in (("offset", offset), ("length", length)):
            if type(n) is not int or n < 0:
                raise _Invalid(f"{_short(key)}: {what} {_short(n)} is not a non-negative integer")
        if offset + length > self.files[name]:
            raise _Invalid(f"{_short(key)}: bytes {offset}+{length} run past the end of {name} ({self.files[name]} bytes)")
        self.ranges.setdefault(name, []).append((offset, length, key))
        return Slice(name, offset, length, None if sizes is None else tuple(sizes))

    def _check_ranges(self) -> None:
        """No two items share bytes: a load never allocates more than the data files hold."""
        for name, ranges in self.ranges.items():
            ranges.sort()
            for (a, n, key), (b, _, other) in zip(ranges, ranges[1:]):
                if a + n > b:
                    raise _Invalid(f"{_short(key)} and {_short(other)} overlap in {name}")


def _json_cost(data: bytes) -> int:
    """At least the peak bytes of the Python objects json.loads makes of ``data``, estimated before it
    runs (a few passes of bytes.count, in C): 30 MiB of ``[[],[],...`` took 775 MiB to parse, and a file
    of the old 512 MiB limit would have taken 13 GiB. Every list, dict, key and value opens with a
    bracket or follows a comma or a colon, and none of them takes more than 128 bytes besides its
    characters (measured: a one-key dict, with a key seen first and a short string), which take at
    most 2 bytes each while parsed if the text is ASCII without \\u escapes, else up to 8 (one wide
    character makes the whole string 4 bytes a character, built twice). Brackets and commas inside
    strings count too: an estimate only ever too high (tests.job.test_sharded measures it)."""
    starts = sum(data.count(c) for c in (b"[", b"{", b",", b":"))
    per_char = 2 if data.isascii() and b"\\u" not in data else 8
    return 128 * starts + per_char * len(data) + 64 * 1024


def _fields(doc: Any, what: str, expected: set[str]) -> None:
    if not isinstance(doc, dict) or set(doc) != expected:
        found = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise _Invalid(f"{what} does not have exactly the fields {sorted(expected)}: {_short(found)}")


def _dims(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or len(value) > MAX_DIMS or any(
            type(d) is not int or not 0 <= d <= MAX_DIM for d in value):
        raise _Invalid(f"{what} is not a list of at most {MAX_DIMS} integers in [0, {MAX_DIM}]: {_short(value)}")
    return value


def _check_cover(key: str, size: list[int], chunks: list[ChunkStorageMetadata]) -> None:
    """The chunks fill the tensor exactly once: their volumes add up to it and no two overlap.

    Overlap is decided on a grid, in O(n log n) for n chunks of any layout (a sweep comparing every
    chunk with every other it meets along one dimension took hours for chunks side by side along
    another). The grid cuts each dimension at every edge of a chunk; a chunk that is exactly one cell
    of it overlaps another only if both are the same cell. DCP's chunks of a DTensor always are cells:
    each mesh dimension cuts one tensor dimension into consecutive pieces, the same pieces whatever the
    other dimensions' cuts, so the chunks are every combination of each dimension's pieces (empty
    pieces, of uneven shards, make empty chunks: they hold nothing and are left out). A chunk across
    several cells, which no DTensor writes, is refused; of disjoint cells, those that add up to the
    tensor's volume cover it.
    """
    if sum(math.prod(c.sizes) for c in chunks) != math.prod(size):
        raise _Invalid(f"{_short(key)}: its chunks do not add up to its size {size}")
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks if math.prod(c.sizes) > 0]
    cuts = [sorted({o[dim] for o, _ in boxes} | {o[dim] + s[dim] for o, s in boxes}) for dim in range(len(size))]
    cell_of = [{edge: i for i, edge in enumerate(edges)} for edges in cuts]
    cells: set[tuple[int, ...]] = set()
    for offsets, sizes in boxes:
        cell = tuple(index[o] for index, o in zip(cell_of, offsets))
        if any(edges[i + 1] != o + s for edges, i, o, s in zip(cuts, cell, offsets, sizes)):
            raise _Invalid(f"{_short(key)}: a chunk {list(offsets)}+{list(sizes)} spans several cells of the grid "
                           "its chunks' edges make (DCP's chunks of a tensor are its cells): they overlap, or "
                           "were not written by DCP")
        if cell in cells:
            raise _Invalid(f"{_short(key)}: two of its chunks overlap")
        cells.add(cell)


def _check_paths(paths: Mapping[str, tuple[str | int, ...]]) -> None:
    """Paths that make one tree: no leaf is also a container, and a container is a dict (string keys)
    or a list (indices), not both."""
    leaves = set(paths.values())
    containers: dict[tuple[str | int, ...], type] = {}
    for key, path in paths.items():
        for depth in range(1, len(path)):
            prefix = path[:depth]
            if prefix in leaves:
                raise _Invalid(f"{_short(key)}: {_short('.'.join(map(str, prefix)))} is both an item and a container")
            kind = type(path[depth])
            if containers.setdefault(prefix, kind) is not kind:
                raise _Invalid(f"{_short(key)}: {_short('.'.join(map(str, prefix)))} is both a dict and a list")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner (flattening, resharding into the given DTensors), with two changes:
    non-tensor items are loaded weights-only, and the top-level entries named in ``fill`` are built
    from the metadata (DCP's way of loading what no live object holds, as for ``dcp_to_torch_save``)."""

    def __init__(self, fill: Collection[str] = ()) -> None:
        super().__init__()
        self.fill = frozenset(fill)

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        if self.fill and metadata is not None:
            for key, entry in metadata.state_dict_metadata.items():
                path = metadata.planner_data[key]
                if path[0] in self.fill:
                    value = (torch.empty(entry.size, dtype=entry.properties.dtype)
                             if isinstance(entry, TensorStorageMetadata) else None)
                    set_element(state_dict, path, value)
        super().set_up_planner(state_dict, metadata, is_coordinator)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        loaded = load_weights_only(value, f"sharded item {read_item.dest_index.fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class SafeReader(StorageReader):
    """Reads the items of a plan from the data files with ``torch.load(weights_only=True)`` (module docstring)."""

    def __init__(self, folder: Path, metadata: Metadata) -> None:
        super().__init__()
        self.folder = folder
        self.metadata = metadata

    @property
    def checkpoint_id(self) -> str:
        return str(self.folder)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen by DCP itself: always handed in with its metadata

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if not isinstance(planner, SafeLoadPlanner):
            raise TypeError("SafeReader loads only with a SafeLoadPlanner (the stock planner unpickles without restriction)")
        by_file: dict[str, list[tuple[Slice, ReadItem]]] = {}
        for item in plan.items:
            where = self.metadata.storage_data[item.storage_index]
            by_file.setdefault(where.file, []).append((where, item))
        for name, reads in sorted(by_file.items()):
            try:
                with open_regular(self.folder / name) as f:
                    for where, item in sorted(reads, key=lambda r: r[0].offset):
                        f.seek(where.offset)
                        data = f.read(where.length)
                        if len(data) != where.length:
                            raise CheckpointLoadError(f"{self.folder}: {name} ends before the bytes of "
                                                      f"{item.storage_index.fqn!r} (truncated?)")
                        if item.type == LoadItemType.BYTE_IO:
                            try:
                                planner.load_bytes(item, io.BytesIO(data))
                            except CheckpointLoadError as e:
                                raise CheckpointLoadError(f"{self.folder}/{name}: {e}") from None
                        else:
                            self._copy(item, where, planner, io.BytesIO(data))
            except OSError as e:
                raise CheckpointLoadError(f"{self.folder}: {name} cannot be read ({e.strerror or e})") from None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _copy(self, item: ReadItem, where: Slice, planner: LoadPlanner, data: io.BytesIO) -> None:
        """One stored chunk, checked against the metadata, into the part of a target DCP planned."""
        key = item.storage_index.fqn
        tensor = load_weights_only(data, f"{self.folder}/{where.file} (chunk of {key!r})")
        entry = self.metadata.state_dict_metadata[key]
        assert isinstance(entry, TensorStorageMetadata)
        if (not isinstance(tensor, torch.Tensor) or tensor.dtype != entry.properties.dtype
                or tuple(tensor.shape) != where.sizes):
            found = f"{tensor.dtype} {tuple(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointLoadError(f"{self.folder}: the chunk of {key!r} in {where.file} holds {found}, its "
                                      f"metadata says {entry.properties.dtype} {where.sizes}: the checkpoint is damaged")
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.shape != tensor.shape:
            raise CheckpointLoadError(f"{self.folder}: {key!r} does not fit this model ({tuple(tensor.shape)} "
                                      f"for {tuple(target.shape)})")
        target.copy_(tensor)
        planner.commit_tensor(item, target)


def load(tree: dict[str, Any], folder: Path, metadata: Metadata, fill: Iterable[str] = (),
         no_dist: bool = False) -> dict[str, Any]:
    """DCP load into ``tree`` in place: its tensors and DTensors (of any sharding) get the checkpoint's
    values, its other entries are replaced, and the top-level entries in ``fill`` are built whole from
    the checkpoint. Collective unless ``no_dist`` (one process reading everything: `job inspect`).

    Any failure, on any rank, is a CheckpointLoadError on every rank.
    """
    fill = tuple(fill)
    for key in fill:  # dcp.load copies back only the top-level keys it was given
        tree.setdefault(key, {})
    try:
        with warnings.catch_warnings():  # no_dist is what we ask for, not a surprise to warn about
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load(tree, storage_reader=SafeReader(folder, metadata), planner=SafeLoadPlanner(fill), no_dist=no_dist)
    except CheckpointException as e:
        raise _load_error(_first_failure(e), folder) from None
    except CheckpointLoadError:
        raise
    except Exception as e:  # noqa: BLE001 - without collectives DCP raises the planner's own errors
        raise _load_error(e, folder) from None
    return tree


def _load_error(cause: BaseException, folder: Path) -> CheckpointLoadError:
    if isinstance(cause, CheckpointLoadError):
        return cause
    return CheckpointLoadError(f"checkpoint {folder} does not fit this model/optimizer ({first_line(cause, 300)}); "
                               "resume it with the --model it was written with, or start a new run in another "
                               "--save-folder/--remote")


def _first_failure(e: CheckpointException) -> BaseException:
    """The exception of the lowest failing rank (DCP gathers every rank's)."""
    failures = e.failures
    return failures[min(failures)][0] if failures else e
