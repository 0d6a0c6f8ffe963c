"""Issue 17, point 4: sharded (FSDP2) checkpoints reshard. Real torchrun processes on CPU (gloo).

A sharded checkpoint written on W ranks loads on W' ranks, model and optimizer, through
torch.distributed.checkpoint; an unsharded one loads sharded and the other way round; `job inspect`
reports one model_sha256 for every sharding of the same weights; and the metadata, JSON instead of
DCP's pickle, is untrusted input: a hostile one is a corrupt checkpoint (exit 6), never code.
"""
from __future__ import annotations

import gc
import io
import itertools
import json
import math
import pickle
import shutil
import struct
import tracemalloc
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from job import dcp_storage
from job.checkpoint import STATE_FILE, describe, load_state_file, open_checkpoint
from job.restore import restore
from job.exceptions import CheckpointLoadError
from job.safe_load import load_weights_only
from job.sharded import by_id, tied_groups
from tests.job.test_checkpoint import _Exploit
from tests.support.checkpoints import reseal, zip_crc32s
from tests.support.hostile import IN_JSON, edit, entries, first_line
from tests.support.jobs import REPO, JobProcess, events, inspect, job_env, run_job, train_config
from tests.support.elastic import (DATASET, TORCHRUN, assert_close, final_model, preempted, resumed, run,
                                   straight_then_resumed)
from tests.support.recording_model import trained
from uploader.hashing import BLOCK_SIZE, file_digest
from uploader.local import list_committed
from uploader.manifest import DCP_METADATA, MANIFEST_NAME, FileEntry, Manifest, strict_json

pytestmark = pytest.mark.slow


def twins(ranks: int, *args: str) -> JobProcess:
    """tests.support.sharded_twins on ``ranks`` processes, to the end."""
    proc = JobProcess([*TORCHRUN, "--nproc-per-node", str(ranks), "-m", "tests.support.sharded_twins", *args],
                      env=job_env(), cwd=REPO)
    proc.wait(240)
    return proc


def newest(folder: Path) -> Path:
    return list_committed(folder)[-1].path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two optimizer steps of the MLP on 2 ranks, saved sharded (``w2``); torch's own gathering of the
    same state (``reference.pt``); the same weights unsharded (``full``)."""
    out = tmp_path_factory.mktemp("twins")
    proc = twins(2, "save", str(out))
    assert proc.proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def resharded(saved: Path) -> dict[str, JobProcess]:
    """The 2-rank checkpoint loaded on 3 ranks (and saved again, ``w3``), that one on 2 (``w2b``), and
    the unsharded one on 2 sharded ranks (``f2``); each compared with the reference by rank 0."""
    return {name: twins(ranks, "check", str(newest(saved / src)), str(saved), name)
            for name, ranks, src in (("w3", 3, "w2"), ("w2b", 2, "w3"), ("f2", 2, "full"))}


@pytest.mark.parametrize("name", ["w3", "w2b", "f2"])
def test_model_and_optimizer_state_reshard_exactly(resharded: dict[str, JobProcess], name: str) -> None:
    """2 -> 3 -> 2 ranks and unsharded -> 2 ranks: what torch gathers after the load is the saved state, bit
    for bit (parameters, Adam's moments and step counts, hyperparameters)."""
    proc = resharded[name]
    compared = [e for e in events(proc.stderr) if e.get("event") == "compared"]
    assert proc.proc.returncode == 0 and compared and compared[0]["equal"], (compared, proc.stderr[-3000:])


def test_inspect_reports_one_model_sha256_for_every_sharding(saved: Path, resharded: dict[str, JobProcess]) -> None:
    # `job inspect` itself for two of them; what it prints (describe) in-process for the others, to save time
    infos = {name: inspect(saved / name) for name in ("w2", "full")}
    infos.update({name: describe(*open_checkpoint(saved / name)) for name in ("w3", "w2b", "f2")})
    assert {name: (info["meta"]["sharded"], info["meta"]["world_size"]) for name, info in infos.items()} == {
        "w2": (True, 2), "w3": (True, 3), "w2b": (True, 2), "full": (False, 1), "f2": (True, 2)}
    assert len({info["model_sha256"] for info in infos.values()}) == 1
    files = {p.name: p.stat().st_size for p in newest(saved / "w3").iterdir()}
    # Each rank's shards in __R_0, whatever else DCP gave it to write (replicated step counts) in __R_1.
    small = sorted(name for name in files if name.endswith("_1.distcp"))
    assert small and set(small) <= {"__0_1.distcp", "__1_1.distcp", "__2_1.distcp"}
    assert max(files[name] for name in small) < min(files[f"__{r}_0.distcp"] for r in range(3))
    assert sorted(set(files) - set(small)) == [
        "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", DCP_METADATA, MANIFEST_NAME, "rank-00000-of-00003.pt",
        "rank-00001-of-00003.pt", "rank-00002-of-00003.pt", "replicated.pt"]


def test_sharded_files_carry_no_torch_crc32(saved: Path) -> None:
    """As for state.pt (tests.job.test_checkpoint): BLAKE3 covers the files, so every torch.save in them, the
    rank files' and the one DCP makes of each item in its data files, skips torch's CRC-32."""
    folder, manifest = open_checkpoint(newest(saved / "w2"))
    items = list(dcp_storage.read_metadata(folder, manifest).storage_data.values())
    assert items and {item.file for item in items} <= {f.path for f in manifest.files}
    for item in items:
        with open(folder / item.file, "rb") as f:
            f.seek(item.offset)
            assert zip_crc32s(f.read(item.length)) == {0}, item
    for name in ("replicated.pt", "rank-00000-of-00002.pt", "rank-00001-of-00002.pt"):
        assert zip_crc32s((folder / name).read_bytes()) == {0}, name


def test_a_sharded_checkpoint_loads_into_one_unsharded_process(saved: Path) -> None:
    from job.build import build
    from job.elastic import for_this_rank

    folder, manifest = open_checkpoint(newest(saved / "w2"))
    reference = torch.load(saved / "reference.pt", weights_only=True)
    tree = load_state_file(folder, manifest)  # DCP reassembles the full tensors, without a process group
    assert tree["model"].keys() == reference["model"].keys()
    assert all(torch.equal(tree["model"][k], reference["model"][k]) for k in reference["model"])
    expected = by_id(reference["optim"])
    assert tree["optimizers"]["AdamW"]["param_groups"] == expected["param_groups"]
    for index, moments in expected["state"].items():
        assert all(torch.equal(tree["optimizers"]["AdamW"]["state"][index][k], v) for k, v in moments.items())
    assert len(tree["per_rank"]) == 2 and all(set(p) == {"rng", "train_metrics", "buffers"} for p in tree["per_rank"])

    state = build(train_config(batch_size=32, grad_accum=1, seed=11)).state
    handover = for_this_rank(tree, 0, 1, seed=11, step=manifest.step, source=str(folder))
    restore(state, handover.tree, str(folder), manifest.step, manifest.timer)
    assert all(torch.equal(p, reference["model"][k]) for k, p in state.model.state_dict().items())
    assert state.timer.batch.value == manifest.step == 2


# -- hostile metadata -------------------------------------------------------------------------------


def _item(doc: dict[str, Any], key: str) -> dict[str, Any]:
    return next(i for i in doc["items"] if i["key"] == key)


def _append_to(folder: Path, name: str, blob: bytes) -> tuple[int, int]:
    """``blob`` added at the end of data file ``name``: its (offset, length)."""
    with open(folder / name, "ab") as f:
        offset = f.tell()
        f.write(blob)
    return offset, len(blob)


def _pickled_exploit(sentinel: Path) -> bytes:
    """A torch file that runs code when unpickled, large enough for any chunk it stands in for."""
    buf = io.BytesIO()
    torch.save({"exploit": _Exploit(sentinel), "padding": torch.zeros(2**14)}, buf)
    return buf.getvalue()


def _point(item: dict[str, Any], where: tuple[int, int]) -> None:
    item["offset"], item["length"] = where


def _chunk(key: str, index: int = 0, **fields: Any) -> Callable[..., None]:
    def edit(doc: dict[str, Any], folder: Path, sentinel: Path) -> None:
        _item(doc, key)["chunks"][index].update(fields)
    return edit


def _swap_slices(doc: dict[str, Any], folder: Path, sentinel: Path) -> None:
    a, b = _item(doc, "model.net.0.weight")["chunks"][0], _item(doc, "model.net.0.bias")["chunks"][0]
    for field in ("file", "offset", "length"):
        a[field], b[field] = b[field], a[field]


def _exploit_in(key: str) -> Callable[..., None]:
    def edit(doc: dict[str, Any], folder: Path, sentinel: Path) -> None:
        item = _item(doc, key)
        target = item["chunks"][0] if item["kind"] == "tensor" else item
        _point(target, _append_to(folder, target["file"], _pickled_exploit(sentinel)))
    return edit


def _reindexed(doc: dict[str, Any], folder: Path, sentinel: Path) -> None:
    item = _item(doc, "optimizers.AdamW.param_groups.0.lr")
    item["path"][3] = 10**9
    item["key"] = ".".join(map(str, item["path"]))


def _leaf_and_container(doc: dict[str, Any], folder: Path, sentinel: Path) -> None:
    lr = _item(doc, "optimizers.AdamW.param_groups.0.lr")
    doc["items"].append({**lr, "key": "model", "path": ["model"]})


def _deflated(blob: bytes) -> bytes:
    """The torch.save ``blob`` with every record DEFLATE-compressed, which torch's reader inflates. The
    records are read from their local headers: the stdlib's reader checks the CRC-32s the job's saves
    leave at 0."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(blob)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            assert info.compress_type == zipfile.ZIP_STORED
            name, extra = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
            start = info.header_offset + 30 + name + extra
            dst.writestr(info.filename, blob[start:start + info.compress_size], compress_type=zipfile.ZIP_DEFLATED)
    return out.getvalue()


def _compressed_in(key: str) -> Callable[..., None]:
    """Metadata that points the item ``key`` at its own bytes, compressed."""
    def edit(doc: dict[str, Any], folder: Path, sentinel: Path) -> None:
        item = _item(doc, key)
        target = item["chunks"][0] if item["kind"] == "tensor" else item
        with open(folder / target["file"], "rb") as f:
            f.seek(target["offset"])
            blob = f.read(target["length"])
        _point(target, _append_to(folder, target["file"], _deflated(blob)))
    return edit


HOSTILE: dict[str, Callable[..., bytes | None]] = {
    "not-json": lambda doc, folder, sentinel: b'{"format": "spot-trainer/dcp-',
    "a-pickle": lambda doc, folder, sentinel: pickle.dumps(_Exploit(sentinel)),  # DCP's stock .metadata format
    "nested-too-deep": lambda doc, folder, sentinel: b"[" * 100_000 + b"]" * 100_000,
    "size-as-strings": lambda doc, folder, sentinel: _item(doc, "model.net.0.weight").update(size=["128", "2"]),
    "bool-offset": _chunk("model.net.0.weight", offset=True),
    "escaping-path": _chunk("model.net.0.weight", file="../../../../../../etc/passwd"),
    "absolute-path": _chunk("model.net.0.weight", file="/etc/passwd"),
    "not-a-data-file": _chunk("model.net.0.weight", file="replicated.pt"),
    "past-the-end": lambda doc, folder, sentinel: _chunk(
        "model.net.0.weight", offset=(folder / _item(doc, "model.net.0.weight")["chunks"][0]["file"]).stat().st_size)(
        doc, folder, sentinel),
    "huge-tensor": lambda doc, folder, sentinel: _item(doc, "model.net.0.bias").update(
        size=[2**40], chunks=[{**_item(doc, "model.net.0.bias")["chunks"][0], "offsets": [0], "sizes": [2**40]}]),
    "overlapping-chunks": _chunk("model.net.0.weight", 1, offsets=[32, 0]),
    "missing-chunk": lambda doc, folder, sentinel: _item(doc, "model.net.0.weight")["chunks"].pop(),
    "unknown-dtype": lambda doc, folder, sentinel: _item(doc, "model.net.0.weight").update(dtype="object"),
    "path-not-the-key": lambda doc, folder, sentinel: _item(doc, "model.net.0.weight").update(
        path=["optimizers", "net.0.weight"]),
    "huge-list-index": _reindexed,
    "leaf-and-container": _leaf_and_container,
    "extra-field": lambda doc, folder, sentinel: _item(doc, "model.net.0.weight").update(exec="import os"),
    "chunk-of-another-shape": _swap_slices,
    "pickled-tensor-chunk": _exploit_in("model.net.3.weight"),
    "pickled-bytes-item": _exploit_in("optimizers.AdamW.param_groups.0.lr"),
    "compressed-tensor-chunk": _compressed_in("model.net.0.weight"),
    "compressed-bytes-item": _compressed_in("optimizers.AdamW.param_groups.0.lr"),
}


def tampered(src: Path, dst: Path, name: str, sentinel: Path) -> tuple[Path, Manifest]:
    """A copy of checkpoint ``src`` with metadata edited as HOSTILE[name] says, and a manifest that
    matches it: every digest checks out, only the content is hostile."""
    shutil.copytree(src, dst)
    doc = json.loads((dst / DCP_METADATA).read_bytes())
    out = HOSTILE[name](doc, dst, sentinel)
    (dst / DCP_METADATA).write_bytes(out if isinstance(out, bytes) else json.dumps(doc).encode())
    old = Manifest.read(dst)
    files = tuple(FileEntry(f.path, *file_digest(dst / f.path, BLOCK_SIZE), BLOCK_SIZE) for f in old.files)
    manifest = Manifest(step=old.step, files=files, timer=old.timer, meta=old.meta, created=old.created)
    (dst / MANIFEST_NAME).write_bytes(manifest.to_json())
    return open_checkpoint(dst)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_metadata_is_a_corrupt_checkpoint_never_code(saved: Path, tmp_path: Path, name: str) -> None:
    sentinel = tmp_path / "pwned"
    folder, manifest = tampered(newest(saved / "w2"), tmp_path / "step-000000000002", name, sentinel)
    with pytest.raises(CheckpointLoadError) as refused:
        load_state_file(folder, manifest)
    assert str(folder) in str(refused.value) and "\n" not in str(refused.value)
    if name not in ("pickled-bytes-item", "compressed-bytes-item"):  # `job inspect` reads the model only
        with pytest.raises(CheckpointLoadError):
            describe(folder, manifest)
    assert not sentinel.exists()


def _metadata_entries(doc: dict[str, Any]) -> Iterator[tuple[Any, ...]]:
    """Every entry of the metadata's top level and of the first item of each layout (a tensor's, a step
    count's of no dimensions, a non-tensor's): the items of one layout are read by the same code."""
    yield from ((key,) for key in doc)
    layouts: dict[tuple[str, int], int] = {}
    for i, item in enumerate(doc["items"]):
        layouts.setdefault((item["kind"], len(item.get("size", []))), i)
    for i in layouts.values():
        yield ("items", i)
        yield from (("items", i, *path) for path in entries(doc["items"][i]))


@pytest.mark.parametrize("value", list(IN_JSON))
def test_no_entry_of_the_metadata_ends_a_load_in_a_traceback(saved: Path, tmp_path: Path, value: str) -> None:
    """Each entry of dcp-metadata.json in turn set to ``value`` (or deleted), sealed again: the load refuses it
    (exit 6), or what it loads resumes on one rank or is refused the same way. Never another error, which
    the CLI prints as a traceback (exit 1). tests/job/test_restore.py sweeps the state the same way."""
    from job.build import build
    from job.elastic import for_this_rank

    src = newest(saved / "w2")
    doc = json.loads((src / DCP_METADATA).read_bytes())
    failures = []
    for n, path in enumerate(_metadata_entries(doc)):
        folder = tmp_path / str(n) / src.name
        shutil.copytree(src, folder)
        edited = json.loads(json.dumps(doc))
        edit(path, IN_JSON[value])(edited)
        (folder / DCP_METADATA).write_text(json.dumps(edited))
        reseal(folder)
        try:
            manifest = Manifest.read(folder)
            tree = load_state_file(folder, manifest)
            state = build(train_config(batch_size=32, grad_accum=1, seed=11)).state
            handover = for_this_rank(tree, 0, 1, seed=11, step=manifest.step, source=str(folder))
            restore(state, handover.tree, str(folder), manifest.step, manifest.timer)
        except CheckpointLoadError as e:
            if str(folder) not in str(e) or "\n" in str(e):
                failures.append(f"{path}: refused without naming the checkpoint in one line: {e}")
        except Exception as e:
            failures.append(f"{path}: {first_line(e)}")
        shutil.rmtree(folder.parent)
    assert n > 20 and not failures, "\n".join(failures)


def test_a_pickled_metadata_file_fails_inspect_and_a_resume_with_exit_6(saved: Path, tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    folder, _ = tampered(newest(saved / "w2"), tmp_path / "ck" / "step-000000000002", "a-pickle", sentinel)
    done = run_job("inspect", str(folder))
    assert done.returncode == 6 and f"{DCP_METADATA} is damaged or hostile" in done.stderr, done.stderr
    ranks = JobProcess([*TORCHRUN, "--nproc-per-node", "2", "-m", "job", "train", "--sharded", "--save-folder",
                        str(tmp_path / "ck"), "--max-duration", "4ba", "--log-format", "json"], env=job_env())
    ranks.wait(120)
    errors = [line for line in ranks.stderr.splitlines() if line.startswith("job: error:")]
    assert len(errors) == 2 and all("is damaged or hostile" in e for e in errors), ranks.stderr[-3000:]  # no rank hangs
    assert not sentinel.exists()


# -- metadata a reader can afford: chunk layouts, JSON size, compressed records ---------------------


def _layout(size: list[int], chunks: list[tuple[list[int], list[int]]]) -> tuple[bytes, dict[str, int]]:
    """Metadata of one bool tensor of ``size`` in ``chunks`` (offsets, sizes), each in its own bytes of one
    data file, and that file's size: what decode_metadata reads of a checkpoint."""
    entries, end = [], 0
    for offsets, sizes in chunks:
        length = max(1, math.prod(sizes))
        entries.append({"offsets": offsets, "sizes": sizes, "file": "__0_0.distcp", "offset": end, "length": length})
        end += length
    doc = {"format": dcp_storage.FORMAT, "format_version": dcp_storage.FORMAT_VERSION, "dcp_version": "",
           "items": [{"key": "w", "path": ["w"], "kind": "tensor", "dtype": "bool", "size": size, "chunks": entries}]}
    return json.dumps(doc, separators=(",", ":")).encode(), {"__0_0.distcp": end}


def _decoded_chunks(size: list[int], chunks: list[tuple[list[int], list[int]]]) -> int:
    return len(dcp_storage.decode_metadata(*_layout(size, chunks), "ck").state_dict_metadata["w"].chunks)


def test_chunks_side_by_side_along_the_last_dimension_decode_in_n_log_n() -> None:
    """200,000 chunks of one row, along dimension 1: the sweep along dimension 0 compared each with every
    other, some 2*10^10 comparisons (8,000 took 16 s, these would take hours); the grid check is linear."""
    n = 200_000
    assert _decoded_chunks([1, n], [([0, i], [1, 1]) for i in range(n)]) == n


def _row(axis: int, n: int, cells: list[tuple[int, int]]) -> tuple[list[int], list[tuple[list[int], list[int]]]]:
    """A 3-dimensional tensor of one row of ``n`` along ``axis``, and chunks (start, length) along that row."""
    size = [1, 1, 1]
    size[axis] = n
    chunks = []
    for start, length in cells:
        offsets, sizes = [0, 0, 0], [1, 1, 1]
        offsets[axis], sizes[axis] = start, length
        chunks.append((offsets, sizes))
    return size, chunks


@pytest.mark.parametrize("axis", [0, 1, 2])
def test_overlapping_chunks_side_by_side_are_refused_along_every_dimension(axis: int) -> None:
    """A row of 10,000 chunks along each dimension: the first covers cells 0-1, the last cell 1 again, and
    cell 9,999 is nobody's (the volumes add up). The same row without the overlap loads."""
    n = 10_000
    units = [(i, 1) for i in range(2, n - 1)]
    assert _decoded_chunks(*_row(axis, n, [(0, 2), *units, (n - 1, 1)])) == n - 1
    with pytest.raises(CheckpointLoadError, match="overlap"):
        _decoded_chunks(*_row(axis, n, [(0, 2), *units, (1, 1)]))


@pytest.mark.parametrize("moved, to", [(([1, 2, 2], [1, 2, 2]), [1, 2, 1]), (([1, 2, 2], [1, 2, 2]), [1, 1, 2]),
                                       (([0, 2, 2], [1, 2, 2]), [0, 1, 1])])
def test_overlapping_blocks_of_a_grid_are_refused(moved: tuple[list[int], list[int]], to: list[int]) -> None:
    """A [2, 4, 4] tensor in eight [1, 2, 2] blocks, one of them moved by one along dimension 3, 2 or both:
    it overlaps its neighbours and leaves a hole (the volumes still add up)."""
    blocks = [([a, b, c], [1, 2, 2]) for a in range(2) for b in (0, 2) for c in (0, 2)]
    assert _decoded_chunks([2, 4, 4], blocks) == 8
    with pytest.raises(CheckpointLoadError, match="overlap"):
        _decoded_chunks([2, 4, 4], [(to, sizes) if (offsets, sizes) == moved else (offsets, sizes)
                                    for offsets, sizes in blocks])


@pytest.mark.parametrize("shape, mesh, placements", [
    ((10, 3), (4,), (Shard(0),)),  # FSDP, uneven: 3, 3, 3, 1
    ((5, 3), (4,), (Shard(0),)),  # 2, 2, 1 and an empty shard
    ((2, 3), (4,), (Shard(0),)),  # two empty shards
    ((3, 7), (2, 3), (Shard(0), Shard(1))),  # 2-D, uneven both ways
    ((7, 5, 3), (2, 2, 2), (Shard(0), Shard(0), Shard(2))),  # dimension 0 cut twice, and dimension 2
    ((4, 6), (2, 3), (Replicate(), Shard(1))),  # TP: replicas are written once
    ((1, 2), (2, 2), (Shard(1), Shard(1))),  # more pieces than elements
])
def test_every_dtensor_layout_is_accepted(shape: tuple[int, ...], mesh: tuple[int, ...],
                                         placements: tuple[Any, ...]) -> None:
    """The chunks DCP writes of a DTensor: each rank's local shape and offset as torch computes them, for
    every rank of the mesh, one chunk per distinct offset (DCP writes replicas once)."""
    chunks: dict[tuple[int, ...], list[int]] = {}
    for coordinate in itertools.product(*map(range, mesh)):
        sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh, list(coordinate), placements)
        chunks[tuple(offsets)] = list(sizes)
    assert _decoded_chunks(list(shape), [(list(o), s) for o, s in chunks.items()]) == len(chunks)


def test_metadata_too_costly_to_parse_is_refused_before_it_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """120 MB of empty lists, under the byte limit: 30 MiB of them took 775 MiB to parse before they were
    refused, these would take some 3 GiB; now they are refused before the parser runs."""
    def parse(data: bytes) -> Any:
        raise AssertionError("parsed")
    monkeypatch.setattr(dcp_storage, "strict_json", parse)
    data = b"[" + b"[]," * 40_000_000 + b"[]]"
    assert len(data) < dcp_storage.MAX_METADATA_BYTES
    with pytest.raises(CheckpointLoadError, match="memory to parse"):
        dcp_storage.decode_metadata(data, {}, "ck")


def test_a_layout_its_reader_would_refuse_is_not_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer holds itself to the reader's limits: a checkpoint the next start would refuse as damaged
    (set aside, its work lost) fails as it is written instead, its layout named."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    offsets = [torch.Size([0, i]) for i in range(100)]
    chunks = [ChunkStorageMetadata(o, torch.Size([1, 1])) for o in offsets]
    metadata = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.bool), torch.Size([1, 100]),
                                                        chunks)},
        storage_data={MetadataIndex("w", o): _StorageInfo("__0_0.distcp", i, 1) for i, o in enumerate(offsets)})
    data = dcp_storage.encode_metadata(metadata)
    assert len(dcp_storage.decode_metadata(data, {"__0_0.distcp": 100}, "ck").state_dict_metadata["w"].chunks) == 100
    monkeypatch.setattr(dcp_storage, "MAX_JSON_COST", dcp_storage._json_cost(data) - 1)
    with pytest.raises(ValueError, match=r"the checkpoint's layout \(100 chunks, 0 MiB of metadata\) is more than"):
        dcp_storage.encode_metadata(metadata)


@pytest.mark.parametrize("unit", [b"[]", b"{}", b"[0]", b'["ab"]', b'"abcdefgh"', b"1000", b"1.5", b"1" * 40,
                                  b'{"a":0}', b"[[[0]]]", b'{"k%d":[]}', b'{"k%d":"ab"}',
                                  '"\u4e00\u4e00"'.encode(), ('"' + "x" * 20 + "\U0001F600" + '"').encode(),
                                  b'"xx\\u4e00"', b'"' + b"x" * 100_000 + b'"'])
def test_the_cost_of_parsing_metadata_is_never_underestimated(unit: bytes) -> None:
    """What the pre-check lets through takes no more memory to parse than it estimated: a list of
    20,000 of ``unit`` (``%d`` a unique number; of a long one, 20 MB of them), as much as tracemalloc sees
    json.loads allocate."""
    count = min(20_000, 20_000_000 // len(unit))
    data = b"[" + b",".join(unit.replace(b"%d", b"%d" % i) for i in range(count)) + b"]"
    gc.collect()
    tracemalloc.start()
    try:
        strict_json(data)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= dcp_storage._json_cost(data)


def test_a_compressed_record_is_refused_before_torch_inflates_it() -> None:
    """A 390 KB slice of a compressed torch.zeros(10^8) made the job allocate 1.5 GB before the dtype check
    refused it. torch reads the compressed file (the refusal is the check's), and the stored one loads."""
    buf = io.BytesIO()
    torch.save({"zeros": torch.zeros(100_000)}, buf)
    bomb = _deflated(buf.getvalue())
    assert len(bomb) < len(buf.getvalue()) // 50
    assert torch.equal(torch.load(io.BytesIO(bomb), weights_only=True)["zeros"], torch.zeros(100_000))
    with pytest.raises(CheckpointLoadError, match="compressed"):
        load_weights_only(io.BytesIO(bomb), "slice")
    assert torch.equal(load_weights_only(io.BytesIO(buf.getvalue()), "slice")["zeros"], torch.zeros(100_000))


@pytest.mark.parametrize("name", ["compressed-tensor-chunk", "compressed-bytes-item"])
def test_a_sharded_checkpoint_with_a_compressed_record_is_corrupt(saved: Path, tmp_path: Path, name: str) -> None:
    """A chunk, and a non-tensor item, pointed at their own bytes compressed: refused for that."""
    folder, manifest = tampered(newest(saved / "w2"), tmp_path / "step-000000000002", name, tmp_path / "pwned")
    with pytest.raises(CheckpointLoadError, match="is compressed") as refused:
        load_state_file(folder, manifest)
    assert str(folder) in str(refused.value) and "\n" not in str(refused.value)


def _settings(change: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    return lambda tree: tree["optimizers"]["AdamW"]["param_groups"][0].update(change)


def _nan_in_the_last_row(tree: dict[str, Any]) -> None:
    """A NaN in the last row of the first weight: in the second rank's shard only (rows split in halves)."""
    weight = next(v for v in tree["model"].values() if v.dim() == 2)
    weight[-1, -1] = float("nan")


@pytest.mark.parametrize("edit, refusal", [
    (_settings({"capturable": True, "fused": True, "foreach": True}), None),
    (_settings({"amsgrad": True}), "AdamW 0 group 0 amsgrad is True, this run's optimizer has False"),
    (_settings({"lr": "fast"}), "AdamW 0 group 0 lr is 'fast', not a number like"),
    (_nan_in_the_last_row, "cannot be trained on: its model."),
], ids=["a GPU run's way of stepping", "amsgrad switched on", "a learning rate of 'fast'", "a NaN one rank holds"])
def test_a_sharded_resume_checks_what_it_read_before_training(
        tmp_path: Path, edit: Callable[[dict[str, Any]], None], refusal: str | None) -> None:
    """A sharded resume loads the optimizers while it reads the checkpoint (job.sharded), before job.restore
    checks them: this run's own settings are read before the read. They were read after it, from the
    checkpoint: a GPU run's capturable=True failed an assertion at the first step, amsgrad a KeyError and
    a learning rate of 'fast' a TypeError, each a traceback. The checkpoint here is a 1-process one, which
    the sharded run loads whole (sharded.load_full_state); a sharded one goes through the same order.
    A NaN is in one rank's shard only: that rank finds it, and the other refuses with it, never trains on."""
    folder = tmp_path / "ck"
    first = run_job("train", "--save-folder", str(folder), "--max-duration", "2ba", "--log-format", "json")
    assert first.returncode == 0, first.stderr[-2000:]
    ckpt = newest(folder)
    tree = torch.load(ckpt / STATE_FILE, weights_only=True)
    edit(tree)
    torch.save(tree, ckpt / STATE_FILE)
    reseal(ckpt)
    ranks = JobProcess([*TORCHRUN, "--nproc-per-node", "2", "-m", "job", "train", "--sharded", "--save-folder",
                        str(folder), "--max-duration", "4ba", "--log-format", "json"], env=job_env())
    ranks.wait(180)
    if refusal is None:
        assert ranks.proc.returncode == 0, ranks.stderr[-3000:]
        group = load_state_file(*open_checkpoint(folder))["optimizers"]["AdamW"]["param_groups"][0]
        assert (group["capturable"], group["fused"], group["foreach"]) == (False, None, None)
        return
    errors = [line for line in ranks.stderr.splitlines() if line.startswith("job: error:")]
    assert len(errors) == 2 and all(refusal in e for e in errors), ranks.stderr[-3000:]  # no rank trains on alone
    assert sum("(seen by another rank)" in e for e in errors) == (edit is _nan_in_the_last_row)
    assert "(exitcode: 6)" in ranks.stderr  # torchrun's own exit code is 1


# -- resuming whole runs on other rank counts -------------------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """The epoch without a stop: sharded on 2 ranks (48 each), and unsharded on 1 (96)."""
    out = {}
    for name, ranks, flags in (("sharded2", 2, ["--sharded", "--batch-size", "48", "--grad-accum", "2"]),
                               ("single", 1, ["--batch-size", "96", "--grad-accum", "4"])):
        base = tmp_path_factory.mktemp(name)
        done = run(ranks, base / "ck", base / "record", *flags)
        assert done.proc.returncode == 0, done.stderr[-3000:]
        assert sorted(trained(base / "record")) == list(range(DATASET))
        out[name] = final_model(base / "ck")
    return out


def test_sharded_2_then_3_then_2_ranks_train_every_sample_once_and_end_close(tmp_path: Path, uninterrupted) -> None:
    folder, record = tmp_path / "ck", tmp_path / "record"
    flags = ["--sharded", "--batch-size", "48", "--grad-accum", "2"]
    first = run(2, folder, record, *flags, stop_after=6)
    assert preempted(first), first.stderr[-3000:]
    second = run(3, folder, record, *flags, stop_after=18)
    assert preempted(second), second.stderr[-3000:]
    third = run(2, folder, record, *flags)
    assert third.proc.returncode == 0, third.stderr[-3000:]

    assert resumed(second, third) == [(2, 3), (3, 2)]
    assert sorted(trained(record)) == list(range(DATASET))  # every sample of the epoch exactly once
    assert_close(final_model(folder), uninterrupted["sharded2"])


def test_unsharded_1_then_sharded_2_ranks_end_close(tmp_path: Path, uninterrupted) -> None:
    """A model that outgrows one device mid-run: its unsharded checkpoint resumes sharded."""
    folder, record = tmp_path / "ck", tmp_path / "record"
    first = run(1, folder, record, "--batch-size", "96", "--grad-accum", "4", stop_after=10)
    assert preempted(first), first.stderr[-3000:]
    done = run(2, folder, record, "--sharded", "--batch-size", "48", "--grad-accum", "2")
    assert done.proc.returncode == 0, done.stderr[-3000:]

    assert resumed(done) == [(1, 2)]
    assert inspect(folder)["meta"]["sharded"] is True
    assert sorted(trained(record)) == list(range(DATASET))
    assert_close(final_model(folder), uninterrupted["single"])


SPARE = ["--model", "tests.support.spare_model:build", "--sharded"]


def test_a_parameter_that_never_had_a_gradient_resumes_sharded_as_it_was(tmp_path: Path) -> None:
    """AdamW keeps no state for a parameter its model's forward never uses, so the checkpoint has none; the
    load's targets had some for every parameter (get_optimizer_state_dict's zero step), and DCP refused
    every resume of such a run as "Missing key" (exit 6). Now it resumes, bit for bit on as many ranks, and
    the parameter still has no state."""
    second, folder, record = straight_then_resumed(tmp_path, 2, 2, *SPARE)
    assert resumed(second) == [(2, 2)] and sorted(trained(record)) == list(range(DATASET))
    weights, expected = final_model(folder), final_model(tmp_path / "straight")
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    moments = load_state_file(*open_checkpoint(folder))["optimizers"]["AdamW"]["state"]
    assert len(moments) == len(weights) - 2  # none for spare.weight and spare.bias


# -- tied weights ------------------------------------------------------------------------------------

TIED = ["--model", "tests.support.tied_model:build", "--sharded", "--batch-size", "48", "--grad-accum", "2"]


def test_children_that_share_a_parameter_are_sharded_as_one_group() -> None:
    """FSDP2 refused a tied model at its first forward when each child was a group of its own."""
    model = torch.nn.Module()
    model.a, model.b, model.c, model.d, model.e = (torch.nn.Linear(2, 2) for _ in range(5))
    model.empty = torch.nn.ReLU()
    model.b.weight = model.a.weight
    model.own = torch.nn.Parameter(torch.zeros(2, 2))
    model.e.weight = model.own  # shared with the root: sharded with the root's own parameters
    assert tied_groups(model) == [[model.a, model.b], [model.c], [model.d]]


def test_a_tied_model_trains_sharded_resumes_on_3_ranks_and_keeps_its_tie(tmp_path: Path) -> None:
    second, folder, record = straight_then_resumed(tmp_path, 2, 3, *TIED)
    assert resumed(second) == [(2, 3)]
    assert [e["deferred_init"] for e in events(second.stderr) if e.get("event") == "built"] == [True]
    assert sorted(trained(record)) == list(range(DATASET))
    weights = final_model(folder)
    assert torch.equal(weights["first.weight"], weights["second.weight"])  # one weight, trained as one
    assert_close(weights, final_model(tmp_path / "straight"))


# -- per-rank buffers --------------------------------------------------------------------------------

NORM = ["--model", "tests.support.norm_model:build", "--sharded"]


def test_each_ranks_own_buffers_resume_with_it_bit_for_bit(tmp_path: Path) -> None:
    """FSDP2 leaves buffers unsynchronized: each rank's BatchNorm statistics (and the model's running shift)
    are its own. DCP saved one copy and loaded it into every rank: the resumed run trained other weights."""
    second, folder, record = straight_then_resumed(tmp_path, 2, 2, *NORM)
    assert resumed(second) == [(2, 2)] and sorted(trained(record)) == list(range(DATASET))
    weights, expected = final_model(folder), final_model(tmp_path / "straight")
    assert all(torch.equal(weights[name], expected[name]) for name in expected), [
        name for name in expected if not torch.equal(weights[name], expected[name])]
    ranks = [load_state_file(*open_checkpoint(f))["per_rank"] for f in (folder, tmp_path / "straight")]
    for mine, theirs in zip(*ranks, strict=True):
        assert mine["buffers"].keys() == {"shift.mean", "norm.running_mean", "norm.running_var",
                                          "norm.num_batches_tracked"}
        assert all(torch.equal(mine["buffers"][k], theirs["buffers"][k]) for k in theirs["buffers"])
    assert not torch.equal(ranks[0][0]["buffers"]["shift.mean"], ranks[0][1]["buffers"]["shift.mean"])


NORM_BUFFERS = {"shift.mean": torch.zeros(2), "norm.running_mean": torch.zeros(2), "norm.running_var": torch.ones(2),
                "norm.num_batches_tracked": torch.tensor(0)}


@pytest.mark.parametrize("saved", [
    [1, 2], {"shift.mean": torch.zeros(2)}, {**NORM_BUFFERS, "shift.mean": torch.zeros(3)},
    {**NORM_BUFFERS, "shift.mean": "x"}, {**NORM_BUFFERS, "norm.num_batches_tracked": torch.tensor(0.0)},
    {**{k: v + 7 for k, v in NORM_BUFFERS.items()},
     "norm.num_batches_tracked": torch.empty((), dtype=torch.int64, device="meta")},
    {1: torch.zeros(2), "x" * 100_000: torch.zeros(2)},
], ids=["not-a-mapping", "missing", "shape", "not-a-tensor", "dtype", "meta-after-good-ones", "hostile-names"])
def test_a_ranks_buffers_that_are_not_the_models_are_a_damaged_checkpoint_and_change_nothing(saved: Any) -> None:
    from job.restore import _load_own_buffers as load_own_buffers
    from job.sharded_layout import own_buffers
    from tests.support.norm_model import build

    model = build()
    before = {k: v.clone() for k, v in own_buffers(model).items()}
    with pytest.raises(CheckpointLoadError, match="is damaged: its rank's buffer") as refused:
        load_own_buffers(model, saved, "ck")
    assert len(str(refused.value)) < 600
    assert all(torch.equal(v, before[k]) for k, v in own_buffers(model).items())
