"""The manifest's versioned format: all three versions read, damaged or unknown ones refused with a reason."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from uploader.exceptions import CorruptCheckpoint, ManifestError, UnsupportedFormat
from uploader.hashing import digest_bytes
from uploader.manifest import FORMAT_VERSION, FileEntry, Manifest

DATA = bytes(range(256)) * 640  # 160 KiB: two whole 64 KiB blocks (the smallest allowed) and a short one
BLOCK = 64 * 1024


def doc(version: int, **entry: Any) -> bytes:
    files = [{"path": "state.pt", "size": len(DATA), "sha256": hashlib.sha256(DATA).hexdigest(), **entry}]
    return json.dumps({"format_version": version, "step": 3, "files": files}).encode()


def folder_with_data(tmp_path: Path) -> Path:
    (tmp_path / "state.pt").write_bytes(DATA)
    return tmp_path


def test_this_build_writes_format_3_with_blake3_block_digests_and_reads_it_back(tmp_path: Path) -> None:
    entry = FileEntry("state.pt", len(DATA), digest_bytes(DATA, BLOCK), block_size=BLOCK)
    manifest = Manifest(step=3, files=(entry,))
    written = json.loads(manifest.to_json())
    assert FORMAT_VERSION == 3 and written["format_version"] == 3
    assert written["files"] == [{"path": "state.pt", "size": len(DATA), "blake3": entry.digest, "block_size": BLOCK}]
    back = Manifest.from_json(manifest.to_json())
    assert back == manifest and back.files[0].algorithm == "blake3"
    back.verify(folder_with_data(tmp_path))


def test_a_manifest_is_the_checkpoint_of_its_own_step_only() -> None:
    """What retention, start-up, pulls and uploads all check (uploader.local, uploader.sync)."""
    manifest = Manifest.from_json(doc(1))
    assert manifest.for_step(3) is manifest
    with pytest.raises(ManifestError, match="^its manifest is for step 3$"):
        manifest.for_step(4)


def test_a_format_2_checkpoint_still_verifies_with_its_sha256_blocks(tmp_path: Path) -> None:
    manifest = Manifest.from_json(doc(2, block_size=BLOCK, sha256=digest_bytes(DATA, BLOCK, "sha256")))
    assert (manifest.format_version, manifest.files[0].algorithm) == (2, "sha256")
    manifest.verify(folder_with_data(tmp_path))
    (tmp_path / "state.pt").write_bytes(DATA[:-1] + b"x")
    with pytest.raises(CorruptCheckpoint, match="fails its sha256 check"):
        manifest.verify(tmp_path)


def test_a_format_3_manifest_may_keep_older_entries_and_checks_its_blake3_ones(tmp_path: Path) -> None:
    blake = {"path": "other.pt", "size": len(DATA), "blake3": digest_bytes(DATA, BLOCK), "block_size": BLOCK}
    raw = json.loads(doc(3))
    raw["files"].append(blake)
    manifest = Manifest.from_json(json.dumps(raw).encode())
    assert [f.algorithm for f in manifest.files] == ["sha256", "blake3"]
    (tmp_path / "other.pt").write_bytes(DATA[:-1] + b"x")
    folder_with_data(tmp_path)
    with pytest.raises(CorruptCheckpoint, match="other.pt fails its blake3 check"):
        manifest.verify(tmp_path)


@pytest.mark.parametrize("entry,why", [
    ({"blake3": "0" * 64, "block_size": BLOCK}, "needs one digest"),  # both a sha256 and a blake3
    ({"sha256": None, "blake3": "0" * 64}, "without its block_size"),
    ({"sha256": None, "blake3": "Z" * 64, "block_size": BLOCK}, "malformed blake3"),
    ({"sha256": None}, "needs one digest"),
])
def test_a_malformed_digest_is_refused(entry: dict[str, Any], why: str) -> None:
    raw = json.loads(doc(3))
    raw["files"][0].update(entry)
    raw["files"][0] = {k: v for k, v in raw["files"][0].items() if v is not None}
    with pytest.raises(ManifestError, match=why):
        Manifest.from_json(json.dumps(raw).encode())


def test_formats_1_and_2_have_no_blake3() -> None:
    for version in (1, 2):
        raw = json.loads(doc(version))
        raw["files"][0] = {"path": "state.pt", "size": len(DATA), "blake3": "0" * 64, "block_size": BLOCK}
        with pytest.raises(ManifestError, match=f"format_version {version} has no blake3"):
            Manifest.from_json(json.dumps(raw).encode())


@pytest.mark.parametrize("version", [1, 2, 3])
def test_an_entry_without_block_size_is_a_plain_sha256(tmp_path: Path, version: int) -> None:
    manifest = Manifest.from_json(doc(version))
    assert manifest.format_version == version and manifest.files[0].block_size is None
    manifest.verify(folder_with_data(tmp_path))


def test_a_block_digest_checked_against_other_bytes_fails(tmp_path: Path) -> None:
    manifest = Manifest.from_json(doc(2, block_size=BLOCK))  # the plain sha256 under a block_size: wrong
    with pytest.raises(CorruptCheckpoint, match="sha256"):
        manifest.verify(folder_with_data(tmp_path))


def test_format_1_has_no_block_size() -> None:
    with pytest.raises(ManifestError, match="format_version 1 has no block_size"):
        Manifest.from_json(doc(1, block_size=BLOCK))


@pytest.mark.parametrize("bad", [0, -1, 1, 2048, 65535, 64 * 1024 * 1024 + 1, "65536", 65536.0, True, [65536]])
def test_a_malformed_block_size_is_refused(bad: Any) -> None:
    with pytest.raises(ManifestError, match="malformed block_size"):
        Manifest.from_json(doc(2, block_size=bad))


@pytest.mark.parametrize("version", [0, 4, "2", None, True, 10 ** 400, "x" * 5000, [], {}, [3]])
def test_an_unknown_format_version_asks_for_an_upgrade(version: Any) -> None:
    with pytest.raises(ManifestError, match="not supported.*upgrade spot-trainer") as raised:
        Manifest.from_json(doc(version))  # type: ignore[arg-type]
    # Only a higher version is a newer build's (refused by resume and pull); the rest are damage (skipped).
    assert isinstance(raised.value, UnsupportedFormat) == (version in (4, 10 ** 400))
    assert len(str(raised.value)) < 200  # one readable line, whatever the file holds


SHARDED = ["dcp-metadata.json", "replicated.pt", "rank-00000-of-00002.pt", "rank-00001-of-00002.pt", "__0_0.distcp",
           "__1_0.distcp"]


def sharded(paths: list[str]) -> bytes:
    files = [{"path": p, "size": 1, "sha256": "0" * 64} for p in paths]
    return json.dumps({"format_version": 2, "step": 3, "files": files, "meta": {"sharded": True}}).encode()


def test_a_sharded_checkpoint_lists_metadata_replicated_state_rank_files_and_data_files() -> None:
    assert [f.path for f in Manifest.from_json(sharded(SHARDED)).files] == SHARDED
    assert Manifest.from_json(sharded([*SHARDED, "__1_1.distcp"]))  # a rank may write several data files


@pytest.mark.parametrize(("paths", "reason"), [
    (SHARDED[1:], "does not list dcp-metadata.json"),
    ([p for p in SHARDED if p != "replicated.pt"], "does not list replicated.pt"),
    ([p for p in SHARDED if p != "rank-00001-of-00002.pt"], "one rank-RRRRR-of-WWWWW.pt per rank"),
    ([*SHARDED, "rank-00000-of-00003.pt"], "one rank-RRRRR-of-WWWWW.pt per rank"),
    ([p for p in SHARDED if not p.endswith(".distcp")], "no data file"),
    ([*SHARDED, "__2_0.distcp"], "a rank beyond its 2 ranks"),
    ([*SHARDED, "__01_0.distcp"], "not part of one"),
    ([*SHARDED, "state.pt"], "not part of one"),
    ([*SHARDED, ".metadata"], "not part of one"),  # DCP's own pickled metadata never belongs to one
    (["shard-00000-of-00002.pt", "shard-00001-of-00002.pt"], "per rank"),  # the layout before DCP
])
def test_a_sharded_manifest_lists_exactly_its_layout(paths: list[str], reason: str) -> None:
    with pytest.raises(ManifestError, match=reason):
        Manifest.from_json(sharded(paths))


@pytest.mark.parametrize(("name", "why"), [
    ("x" * 256, "longer than 255 bytes"),
    ("sub/" + "é" * 128, "longer than 255 bytes"),  # 128 characters, 256 bytes in UTF-8
    ("\ud800.pt", "not valid Unicode"),
    ("/".join(["é" * 100] * 6), "longer than 1024 bytes"),  # 605 characters, 1205 bytes
])
def test_a_name_no_filesystem_can_hold_is_a_damaged_manifest(name: str, why: str) -> None:
    """Refused as damage (skipped, set aside), not met later as a local error that reads like a bad disk."""
    raw = json.loads(doc(3))
    raw["files"].append({**raw["files"][0], "path": name})
    with pytest.raises(ManifestError, match=why):
        Manifest.from_json(json.dumps(raw).encode())
    raw["files"][1]["path"] = "x" * 255
    assert Manifest.from_json(json.dumps(raw).encode()).files[1].path == "x" * 255


@pytest.mark.parametrize("name", ["manifest.json", "manifest.json/x", "manifest.json/sub/x"])
def test_no_file_may_take_the_manifests_place(name: str) -> None:
    """A folder named manifest.json would make the download's commit fail as a bad local disk (exit 7, at
    every start) instead of skipping a damaged checkpoint."""
    raw = json.loads(doc(3))
    raw["files"].append({**raw["files"][0], "path": name})
    with pytest.raises(ManifestError, match="that is where the manifest goes"):
        Manifest.from_json(json.dumps(raw).encode())


def test_paths_have_at_most_32_parts_and_clash_at_any_depth() -> None:
    raw = json.loads(doc(3))
    deep = "/".join("d" * 32)  # 32 parts: 31 folders and a file
    raw["files"].append({**raw["files"][0], "path": deep})
    assert Manifest.from_json(json.dumps(raw).encode()).files[1].path == deep
    raw["files"].append({**raw["files"][0], "path": deep + "/e"})
    with pytest.raises(ManifestError, match=r"more than 32 parts \(its folders and itself\)"):
        Manifest.from_json(json.dumps(raw).encode())
    raw["files"][2]["path"] = deep[:-2]  # a file, and the folder of the file ``deep``
    with pytest.raises(ManifestError, match="both as a file and as a folder"):
        Manifest.from_json(json.dumps(raw).encode())


def nested_meta(depth: int, inner: str = '"[[[ \\" {{ not brackets"') -> bytes:
    """A manifest whose meta holds lists ``depth`` - 2 deep (the manifest and its meta are two levels),
    around a string full of brackets that are not JSON's."""
    lists = "[" * (depth - 2) + inner + "]" * (depth - 2)
    return doc(3)[:-1] + f', "meta": {{"x": {lists}}}}}'.encode()


def called_from_deep(frames: int, call: Any) -> Any:
    return call() if frames == 0 else called_from_deep(frames - 1, call)


@pytest.mark.parametrize("inner", ['"[[[ \\" {{ not brackets"', '"[[[[ {{ no escapes"', '"\\\\"'],
                         ids=["an escaped quote", "no backslash", "a backslash at the end"])
def test_nesting_beyond_32_levels_is_refused_whatever_the_callers_stack(inner: str) -> None:
    """Where json gives up depends on the stack it is called from: a manifest nested 975 levels deep
    parsed in the pull's thread and failed in the training thread (exit 6 once, then a skip)."""
    assert Manifest.from_json(nested_meta(32, inner)).meta["x"]
    for depth in (33, 600, 975):
        data = nested_meta(depth, inner)
        for frames in (0, 800):
            with pytest.raises(ManifestError, match="nested more than 32 levels deep"):
                called_from_deep(frames, lambda data=data: Manifest.from_json(data))


@pytest.mark.parametrize("number", [b"1e400", b"-1e400"])
def test_a_number_beyond_a_float_is_damage_like_infinity(number: bytes) -> None:
    """Python's json reads 1e400 as inf: a global batch of it once ended in OverflowError (exit 1)."""
    with pytest.raises(ManifestError, match="is beyond what a number can hold"):
        Manifest.from_json(doc(3)[:-1] + b', "meta": {"global_batch": ' + number + b"}}")
    assert Manifest.from_json(doc(3)[:-1] + b', "meta": {"x": 1e300}}').meta["x"] == 1e300


@pytest.mark.parametrize("data", [b'"' + b'\\"' * 400_000, b'{"a": "' + b'\\' * 800_000, b'["\\"' * 200_000],
                         ids=["an open string of escaped quotes", "an open string of backslashes", "open strings"])
def test_the_nesting_check_takes_linear_time_on_strings_that_never_close(data: bytes) -> None:
    """The check's regular expression backtracked over an open string from every quote: 32 KB of them took
    4 s, the 8 MB a manifest may have would take hours. Refused here at once (the suite's timeout is the
    bound: no wall clock is asserted)."""
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(data)


def test_a_manifest_is_utf_8() -> None:
    """json.loads takes UTF-16 too, whose bytes can hold '[' and '"' inside a character: the nesting check
    reads UTF-8."""
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json(doc(3).decode().encode("utf-16"))
