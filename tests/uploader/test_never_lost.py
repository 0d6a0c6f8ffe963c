"""Issue 16: corrupt and hand-made checkpoints, on disk and in the bucket, never cost good work.

Each test plays an adversarial user against the real protocol (a folder, or SeaweedFS): retention,
pulls, listing and start-up must skip or set aside the bad checkpoint and keep the good ones.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.checkpoints import (
    checkpoints_of,
    complete_steps,
    corrupt_file,
    data_files_of,
    files_of,
    make_checkpoint,
)
from tests.support.recording import RecordingRemote
from uploader.exceptions import BucketNotFound, CorruptCheckpoint, ManifestError, StorageError
from uploader.filesystem import FileRemote
from uploader.layout import data_key, manifest_key
from uploader.local import (
    LocalCheckpoint,
    checkpoint_name,
    clean_staging,
    list_committed,
    list_set_aside,
    newest_verified,
    parse_step,
    prune,
)
from uploader.manifest import MAX_MANIFEST_BYTES, MANIFEST_NAME, Manifest
from uploader.remote import Remote
from uploader.sync import list_remote, list_set_aside as remote_set_aside, pull_newest, push, push_all

# -- 1. retention never deletes good work ---------------------------------------------------------


def test_local_retention_counts_back_from_the_checkpoint_just_committed(tmp_path: Path) -> None:
    """The issue's run B: 64 is corrupt and newest by step; --keep 1 after committing 60 must keep 60."""
    folder = tmp_path / "ckpts"
    for step in (32, 48, 52, 60, 64):
        make_checkpoint(folder, step)
    removed = prune(folder, keep=1, newest=60)
    assert sorted(p.name for p in removed) == [checkpoint_name(s) for s in (32, 48, 52)]
    assert [c.step for c in list_committed(folder)] == [60, 64]  # 64 is not counted, nor deleted


def test_start_up_sets_a_corrupt_checkpoint_aside_for_good(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    for step in (32, 48, 64):
        make_checkpoint(folder, step)
    corrupt_file(folder / checkpoint_name(64) / "state.pt")
    before = files_of(folder / checkpoint_name(64))

    found = newest_verified(folder, set_aside_corrupt=True)

    assert found is not None and found[0].step == 48
    assert [c.step for c in list_committed(folder)] == [32, 48]
    (aside,) = list_set_aside(folder)
    assert aside.name.startswith("corrupt-step-000000000064-") and files_of(aside) == before  # kept, untouched
    make_checkpoint(folder, 52)
    prune(folder, keep=1, newest=52)
    assert [c.step for c in list_committed(folder)] == [52] and list_set_aside(folder) == [aside]


def test_a_pull_sets_a_corrupt_remote_checkpoint_aside_and_retention_keeps_the_new_one(
    remote: Remote, local: Path, restore: Path
) -> None:
    """The issue's new node: the bucket holds 32, 48 and a corrupt 64; it resumes from 48 with --keep 1."""
    for step in (32, 48, 64):
        push(make_checkpoint(local, step), remote, keep=3)
    key = data_key(checkpoint_name(64), "state.pt")
    damaged = bytearray(remote.read_bytes(key) or b"")
    damaged[100] ^= 0xFF
    remote.write_bytes(key, bytes(damaged))

    pulled = pull_newest(remote, restore)

    assert pulled is not None and pulled.step == 48
    assert complete_steps(remote) == [32, 48]
    (aside,) = remote_set_aside(remote)
    assert aside.startswith("corrupt-step-000000000064-")
    assert remote.read_bytes(f"{aside}/state.pt") == bytes(damaged)  # kept for inspection, data and all
    assert remote.read_bytes(f"{aside}/{MANIFEST_NAME}") is not None

    for step in (52, 60):
        push(make_checkpoint(restore, step), remote, keep=1)
    assert complete_steps(remote) == [60]
    assert remote_set_aside(remote) == [aside]  # never counted in --keep, never deleted


def test_remote_retention_never_deletes_for_a_newer_checkpoint_it_did_not_write(remote: Remote, local: Path) -> None:
    """A newer complete checkpoint that could not be set aside (read-only reader, another run) is
    neither counted nor deleted: the good ones up to the one just pushed stay."""
    for step in (32, 48, 64):
        push(make_checkpoint(local, step), remote, keep=3)
    (local / checkpoint_name(64) / MANIFEST_NAME).unlink()  # this node never had 64
    push(make_checkpoint(local, 52), remote, keep=2)
    assert complete_steps(remote) == [48, 52, 64]


# Manifests that are there but do not make a checkpoint, each made from a good one's document.
UNUSABLE: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "not-json": lambda doc: b"not json",
    "another-step": lambda doc: json.dumps({**doc, "step": doc["step"] - 1}).encode(),
    "newer-format": lambda doc: json.dumps({**doc, "format_version": 99}).encode(),
}


def _unusable_manifest(ckpt: LocalCheckpoint, name: str) -> bytes:
    return UNUSABLE[name](json.loads(ckpt.manifest().to_json()))


@pytest.mark.parametrize("name", sorted(UNUSABLE))
def test_remote_retention_counts_and_deletes_only_checkpoints_whose_manifest_parses(
    remote: Remote, local: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Review B, 04: good 2 and 4 and an unusable 5 in the bucket; --keep 2 after uploading 6 used to delete
    2 and 4, keeping 5 and 6. A manifest that does not parse (or is another step's) is no checkpoint."""
    for step in (2, 4):
        push(make_checkpoint(local, step), remote, keep=5)
    garbage = _with_manifest(remote, local, 5, lambda ckpt: _unusable_manifest(ckpt, name))

    with caplog.at_level(logging.WARNING, logger="uploader.sync"):
        push(make_checkpoint(local, 6), remote, keep=2)

    assert complete_steps(remote) == [4, 5, 6]
    assert remote.read_bytes(manifest_key(checkpoint_name(5))) == garbage  # neither counted nor deleted
    assert f"retention: {checkpoint_name(5)} on {remote.url} is neither counted nor deleted" in caplog.text


@pytest.mark.parametrize("name", sorted(UNUSABLE))
def test_local_retention_counts_and_deletes_only_checkpoints_whose_manifest_parses(
    tmp_path: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "ckpts"
    ckpts = {step: make_checkpoint(folder, step) for step in (2, 4, 5, 6)}
    (ckpts[5].path / MANIFEST_NAME).write_bytes(_unusable_manifest(ckpts[5], name))

    with caplog.at_level(logging.WARNING, logger="uploader.local"):
        removed = prune(folder, keep=2, newest=6)

    assert removed == [ckpts[2].path]
    assert [c.step for c in list_committed(folder)] == [4, 5, 6]
    assert f"retention: {ckpts[5].path} is neither counted nor deleted" in caplog.text


# -- 3. bounded work for any manifest -------------------------------------------------------------


def test_remote_retention_warns_once_about_each_checkpoint_it_leaves_alone(
    remote: Remote, local: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Retention runs after every upload. A checkpoint it must leave alone (a manifest that does not parse,
    a newer one this node did not write) was warned about at every upload, every 30 seconds for as long as
    it stayed; now at the first, and at DEBUG after that."""
    push(make_checkpoint(local, 64), remote, keep=5)
    (local / checkpoint_name(64) / MANIFEST_NAME).unlink()  # this node never had 64
    _with_manifest(remote, local, 5, b"not json")

    with caplog.at_level(logging.DEBUG, logger="uploader.sync"):
        for step in (6, 8, 10):
            push(make_checkpoint(local, step), remote, keep=5)

    def said(level: int, words: str) -> int:
        return sum(r.levelno == level and words in r.getMessage() for r in caplog.records)
    unusable = f"retention: {checkpoint_name(5)} on {remote.url} is neither counted nor deleted"
    newer = f"retention: {checkpoint_name(64)} on {remote.url} is newer than the checkpoint just uploaded"
    assert (said(logging.WARNING, unusable), said(logging.DEBUG, unusable)) == (1, 2)
    assert (said(logging.WARNING, newer), said(logging.DEBUG, newer)) == (1, 3)  # first seen by the upload of 5
    assert complete_steps(remote) == [5, 6, 8, 10, 64]  # still neither counted nor deleted


def _with_manifest(remote: Remote, local: Path, step: int,
                   raw: bytes | Callable[[LocalCheckpoint], bytes]) -> bytes:
    """Upload a good checkpoint of ``step``, then replace its manifest with ``raw`` (or what it makes of the
    checkpoint); returns the bytes written."""
    ckpt = make_checkpoint(local, step)
    push(ckpt, remote, keep=5)
    data = raw if isinstance(raw, bytes) else raw(ckpt)
    remote.write_bytes(manifest_key(ckpt.name), data)
    return data


def _node_part_of(ckpt: LocalCheckpoint) -> bytes:
    """``ckpt``'s manifest made one node's part of a save, with no files at all: what a bucket may hold at a
    whole checkpoint's key (hand-made, or a part copied to the wrong key)."""
    doc = json.loads((ckpt.path / MANIFEST_NAME).read_text())
    doc["files"] = []
    doc["meta"].update(node=0, nodes=1, save_id="abc")
    return json.dumps(doc).encode()


def test_a_node_parts_manifest_at_a_whole_checkpoints_key_is_never_pulled_nor_counted(
        remote: Remote, local: Path, restore: Path) -> None:
    """A part's payload is checked only on the whole it joins: at the whole's key one was pulled as the newest
    complete checkpoint (every start then failed, "state.pt is missing"), and retention counted it, deleting
    a good checkpoint below it (review)."""
    push(make_checkpoint(local, 10), remote, keep=3)
    _with_manifest(remote, local, 20, _node_part_of)

    for step in (30, 40):
        push(make_checkpoint(local, step), remote, keep=3)
    assert complete_steps(remote) == [10, 20, 30, 40]  # 20 neither counted nor deleted: 10 is one of the 3 kept
    remote.delete([manifest_key(checkpoint_name(step)) for step in (30, 40)])  # 20 is the newest "complete" one

    pulled = pull_newest(remote, restore)
    assert pulled is not None and pulled.step == 10
    assert [name[:26] for name in remote_set_aside(remote)] == ["corrupt-step-000000000020-"]  # out of the way


def test_an_oversized_manifest_is_read_no_further_than_the_cap(remote: Remote, local: Path, restore: Path) -> None:
    push(make_checkpoint(local, 10), remote, keep=5)
    _with_manifest(remote, local, 20, b" " * (MAX_MANIFEST_BYTES + 4096) + b"{}")
    assert len(remote.read_bytes(manifest_key(checkpoint_name(20)), limit=1000) or b"") == 1001
    pulled = pull_newest(remote, restore)
    assert pulled is not None and pulled.step == 10


def test_a_file_remote_never_follows_a_link_to_dev_zero(tmp_path: Path, restore: Path) -> None:
    """A planted link to /dev/zero as a checkpoint file used to be copied until the file size limit."""
    root = tmp_path / "remote"
    remote = FileRemote(root)
    push(make_checkpoint(tmp_path / "a", 10), remote, keep=5)
    push(make_checkpoint(tmp_path / "a", 20), remote, keep=5)
    state = root / checkpoint_name(20) / "state.pt"
    state.unlink()
    state.symlink_to("/dev/zero")

    assert "state.pt" not in {o.key.rpartition("/")[2] for o in remote.list(checkpoint_name(20))}
    assert remote.head(data_key(checkpoint_name(20), "state.pt")) is None
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        remote.get_file(data_key(checkpoint_name(20), "state.pt"), tmp_path / "out", size=10, digest="0" * 64,
                        algorithm="sha256")
    pulled = pull_newest(remote, restore, set_aside_corrupt=False)
    assert pulled is not None and pulled.step == 10


def test_a_file_remote_folder_that_cannot_be_read_fails_the_listing_rather_than_hiding_its_checkpoint(
        tmp_path: Path, restore: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An NFS error on the newest checkpoint's folder used to leave it out of the listing silently: the
    pull then took the older one as the newest. Now the pull stops with the storage's error."""
    root = tmp_path / "remote"
    remote = FileRemote(root)
    push(make_checkpoint(tmp_path / "a", 10), remote, keep=5)
    push(make_checkpoint(tmp_path / "a", 20), remote, keep=5)
    scandir = os.scandir

    def failing(path: Any = ".") -> Any:
        if Path(path) == root / checkpoint_name(20):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return scandir(path)

    monkeypatch.setattr(os, "scandir", failing)
    with pytest.raises(StorageError, match=f"cannot list folder '{root}': Input/output error$"):
        pull_newest(remote, restore)
    assert not restore.exists() or list_committed(restore) == []


def test_a_file_remote_object_longer_than_declared_is_refused_before_a_byte_is_copied(tmp_path: Path) -> None:
    remote = FileRemote(tmp_path / "remote")
    remote.write_bytes("step-000000000001/state.pt", os.urandom(3 * 1024 * 1024))
    out = tmp_path / "out"
    with pytest.raises(CorruptCheckpoint, match=f"has {3 * 1024 * 1024} bytes, the manifest says 1000$"):
        remote.get_file("step-000000000001/state.pt", out, size=1000, digest="0" * 64, algorithm="sha256")
    assert not out.exists()


def test_a_file_remote_object_growing_while_copied_stops_one_byte_past_the_declared_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    remote = FileRemote(tmp_path / "remote")
    remote.write_bytes("step-000000000001/state.pt", os.urandom(3 * 1024 * 1024))
    real_fstat = os.fstat
    # Measured at 1000 bytes, as if written to after that: the copy must still stop at 1001.
    monkeypatch.setattr(os, "fstat", lambda fd: os.stat_result((*real_fstat(fd)[:6], 1000, *real_fstat(fd)[7:])))
    out = tmp_path / "out"
    with pytest.raises(CorruptCheckpoint, match="more than 1000 bytes"):
        remote.get_file("step-000000000001/state.pt", out, size=1000, digest="0" * 64, algorithm="sha256")
    assert out.stat().st_size == 1001


# -- 4. a hostile or malformed manifest is a corrupt checkpoint, never a crash ---------------------


def _good_doc(folder: Path) -> dict[str, Any]:
    return json.loads(make_checkpoint(folder, 30).manifest().to_json())


def _nested(doc: dict[str, Any]) -> bytes:
    return json.dumps({**doc, "meta": {}}).encode().replace(b'"meta": {}', b'"meta": ' + b"[" * 100_000 + b"]" * 100_000)


def _files(*paths: str) -> Callable[[dict[str, Any]], bytes]:
    def edit(doc: dict[str, Any]) -> bytes:
        entry = doc["files"][0]
        return json.dumps({**doc, "files": [{**entry, "path": p} for p in paths]}).encode()

    return edit


HOSTILE: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "deep-nesting": _nested,
    "infinite-size": lambda d: json.dumps(d).replace(str(d["files"][0]["size"]), "Infinity", 1).encode(),
    "huge-integer-size": lambda d: json.dumps({**d, "files": [{**d["files"][0], "size": 10**30}]}).encode(),
    "string-created": lambda d: json.dumps({**d, "created": "yesterday"}).encode(),
    "bool-step": lambda d: json.dumps({**d, "step": True}).encode(),
    "float-timer": lambda d: json.dumps({**d, "timer": {"batch": 1.5}}).encode(),
    "file-and-folder": _files("state.pt", "x", "x/y"),
    "state-is-a-folder": _files("state.pt/x"),
    "no-files": lambda d: json.dumps({**d, "files": []}).encode(),
    "files-not-a-list": lambda d: json.dumps({**d, "files": {"state.pt": 1}}).encode(),
    "entry-not-an-object": lambda d: json.dumps({**d, "files": ["state.pt"]}).encode(),
    "sha256-not-hex": lambda d: json.dumps({**d, "files": [{**d["files"][0], "sha256": "zz"}]}).encode(),
    "tiny-block-size": lambda d: json.dumps({**d, "files": [{**d["files"][0], "block_size": 1}]}).encode(),
    "meta-not-an-object": lambda d: json.dumps({**d, "meta": []}).encode(),
    "half-sharded": lambda d: json.dumps({**json.loads(_files("dcp-metadata.json", "replicated.pt", "__0_0.distcp",
                                                             "rank-00000-of-00002.pt")(d)),
                                          "meta": {"sharded": True}}).encode(),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_manifest_is_refused_as_damage(tmp_path: Path, name: str) -> None:
    with pytest.raises(ManifestError):
        Manifest.from_json(HOSTILE[name](_good_doc(tmp_path)))


@pytest.mark.parametrize("name", ["deep-nesting", "infinite-size", "string-created", "file-and-folder",
                                  "state-is-a-folder", "no-files"])
def test_a_pull_skips_a_hostile_manifest_for_the_older_good_checkpoint(
    remote: Remote, local: Path, restore: Path, name: str
) -> None:
    good = make_checkpoint(local, 10)
    push(good, remote, keep=5)
    doc = json.loads(make_checkpoint(local, 20).manifest().to_json())
    _with_manifest(remote, local, 20, HOSTILE[name](doc))

    pulled = pull_newest(remote, restore)

    assert pulled is not None and pulled.step == 10 and data_files_of(pulled.path) == data_files_of(good.path)
    assert complete_steps(remote) == [10] and len(remote_set_aside(remote)) == 1


@pytest.mark.parametrize("name", ["deep-nesting", "infinite-size", "state-is-a-folder", "no-files"])
def test_a_local_hostile_manifest_is_skipped_for_the_older_good_checkpoint(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "ckpts"
    make_checkpoint(folder, 10)
    newest = make_checkpoint(folder, 20)
    (newest.path / MANIFEST_NAME).write_bytes(HOSTILE[name](json.loads(newest.manifest().to_json())))
    found = newest_verified(folder, set_aside_corrupt=True)
    assert found is not None and found[0].step == 10
    assert [c.step for c in list_committed(folder)] == [10] and len(list_set_aside(folder)) == 1


# -- 6. names and links ----------------------------------------------------------------------------


def test_step_names_take_ascii_digits_only(tmp_path: Path) -> None:
    arabic = "step-" + "\u0661" * 12  # ARABIC-INDIC DIGIT ONE: \d matches it, int() reads it
    assert parse_step(arabic) is None and parse_step("step-000000000032") == 32
    folder = tmp_path / "ckpts"
    for step in (16, 32, 48):
        make_checkpoint(folder, step)
    planted = make_checkpoint(tmp_path / "elsewhere", 7).path.rename(folder / arabic)
    assert [c.step for c in list_committed(folder)] == [16, 32, 48]
    prune(folder, keep=3, newest=48)
    assert [c.step for c in list_committed(folder)] == [16, 32, 48] and planted.is_dir()


def test_retention_and_cleanup_never_follow_a_link(tmp_path: Path) -> None:
    other_run = make_checkpoint(tmp_path / "other-run", 5)
    before = files_of(other_run.path)
    folder = tmp_path / "ckpts"
    make_checkpoint(folder, 10)
    (folder / checkpoint_name(1)).symlink_to(other_run.path, target_is_directory=True)
    (folder / ".staging-step-000000000002-1").symlink_to(other_run.path, target_is_directory=True)
    make_checkpoint(folder, 20)

    assert [c.step for c in list_committed(folder)] == [10, 20]
    prune(folder, keep=1, newest=20)
    clean_staging(folder)

    assert files_of(other_run.path) == before  # nothing deleted through either link
    assert [c.step for c in list_committed(folder)] == [20]
    assert (folder / checkpoint_name(1)).is_symlink()


def test_file_remote_retention_never_deletes_through_a_linked_folder(tmp_path: Path) -> None:
    other_run = make_checkpoint(tmp_path / "other-run", 5)
    before = files_of(other_run.path)
    root = tmp_path / "remote"
    remote = FileRemote(root)
    push(make_checkpoint(tmp_path / "a", 10), remote, keep=1)
    (root / checkpoint_name(1)).symlink_to(other_run.path, target_is_directory=True)
    push(make_checkpoint(tmp_path / "a", 20), remote, keep=1)
    assert complete_steps(remote) == [20] and files_of(other_run.path) == before
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        remote.read_bytes(manifest_key(checkpoint_name(1)))


def _folder_as_manifest(root: Path, name: str) -> None:
    (root / name / MANIFEST_NAME).mkdir(parents=True)


def _fifo_as_manifest(root: Path, name: str) -> None:
    (root / name).mkdir(parents=True)
    os.mkfifo(root / name / MANIFEST_NAME)


def _link_as_checkpoint(root: Path, name: str) -> None:
    root.mkdir(parents=True)
    (root / name).symlink_to(make_checkpoint(root.parent / "other-run", 4).path, target_is_directory=True)


def _file_as_checkpoint(root: Path, name: str) -> None:
    root.mkdir(parents=True)
    (root / name).write_text("not a folder")


# What a hostile user can put where a file:// remote keeps a checkpoint's manifest: never an object.
NOT_AN_OBJECT: dict[str, Callable[[Path, str], None]] = {
    "folder-as-manifest": _folder_as_manifest,
    "fifo-as-manifest": _fifo_as_manifest,
    "link-as-checkpoint": _link_as_checkpoint,
    "file-as-checkpoint": _file_as_checkpoint,
}


@pytest.mark.parametrize("entry", sorted(NOT_AN_OBJECT))
def test_a_remote_entry_that_is_not_an_object_never_sets_the_good_local_checkpoint_aside(
    tmp_path: Path, local: Path, entry: str
) -> None:
    """Review B, 01: a folder where the remote manifest of step 4 goes made `sync` set the good local step 4
    aside and exit 0. The damage is the remote's: the upload stops, naming it, and nothing local changes."""
    root = tmp_path / "remote"
    remote = FileRemote(root)
    for step in (2, 4):
        make_checkpoint(local, step)
    before = checkpoints_of(local)
    NOT_AN_OBJECT[entry](root, checkpoint_name(4))
    outside = files_of(tmp_path / "other-run")  # where the link leads, if there is one

    with pytest.raises(CorruptCheckpoint, match=f"cannot upload {checkpoint_name(4)} to {remote.url}: .*"
                                                f"{checkpoint_name(4)}/{MANIFEST_NAME} is not a regular file.*remove"):
        push_all(local, remote, keep=3)

    assert checkpoints_of(local) == before and list_set_aside(local) == []
    assert complete_steps(remote) == [2] and os.path.lexists(root / checkpoint_name(4))
    assert files_of(tmp_path / "other-run") == outside  # nothing written through the link


@pytest.mark.parametrize("name", ["not-json", "another-step"])
def test_an_unusable_remote_manifest_of_the_step_being_uploaded_is_replaced_never_a_reason_to_set_local_aside(
    remote: Remote, local: Path, name: str
) -> None:
    """The same rule on S3 and file://: only a local checkpoint that fails its own verification is set aside."""
    _with_manifest(remote, local, 4, lambda ckpt: _unusable_manifest(ckpt, name))
    (ckpt,) = list_committed(local)

    assert push_all(local, remote, keep=3) == [4]

    assert list_committed(local) == [ckpt] and list_set_aside(local) == []
    assert Manifest.from_json(remote.read_bytes(manifest_key(ckpt.name)) or b"") == ckpt.manifest()


def _linked_to_a_file_elsewhere(path: Path) -> None:
    """A link to a file outside the checkpoint with the very bytes the manifest expects: it verifies."""
    elsewhere = path.parent.parent.parent / "elsewhere.bin"
    path.rename(elsewhere)
    path.symlink_to(elsewhere)


def _linked_to_dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _sparse_50_gb(path: Path) -> None:
    os.truncate(path, 50 * 1024 ** 3)


@pytest.mark.parametrize("plant", [_linked_to_a_file_elsewhere, _linked_to_dev_zero, _sparse_50_gb],
                         ids=["link-elsewhere", "link-to-dev-zero", "sparse-50GB"])
def test_an_upload_reads_no_link_and_no_byte_past_the_manifest_size(remote: Remote, local: Path,
                                                                   plant: Callable[[Path], None]) -> None:
    """Review B, 02: a link planted in a checkpoint folder sent what it named to the bucket (a file
    elsewhere on the node, committed; /dev/zero without end), and a sparse file was read whole."""
    ckpt = make_checkpoint(local, 4)
    plant(ckpt.path / "state.pt")

    assert push_all(local, remote, keep=3) == []

    (aside,) = list_set_aside(local)
    assert list_committed(local) == [] and aside.name.startswith("corrupt-step-000000000004-")
    assert complete_steps(remote) == [] and not [o for o in remote.list("") if o.size > 1_000_000]


class ResavedDuringUpload(RecordingRemote):
    """The job saves the step again (other bytes) while the uploader sends the first file of it."""

    def __init__(self, inner: Remote, folder: Path, step: int) -> None:
        super().__init__(inner)
        self.folder, self.step, self.resaved = folder, step, False

    def put_file(self, key: str, path: Path, **kwargs: Any) -> None:
        if not self.resaved:
            self.resaved = True
            make_checkpoint(self.folder, self.step, seed=99)
        super().put_file(key, path, **kwargs)


def test_a_checkpoint_saved_again_during_its_upload_is_never_set_aside(remote: Remote, local: Path) -> None:
    """Review of session 15: the upload of the first save fails (its files changed under it), and the new
    save, which is good, was set aside in its place."""
    make_checkpoint(local, 4)

    assert push_all(local, ResavedDuringUpload(remote, local, 4), keep=3) == []

    assert list_set_aside(local) == [] and [c.step for c in list_committed(local)] == [4]
    assert push_all(local, remote, keep=3) == [4]  # the next pass uploads the new save
    assert data_files_of(local / checkpoint_name(4)) == {k: remote.read_bytes(data_key(checkpoint_name(4), k))
                                                         for k in data_files_of(local / checkpoint_name(4))}


# -- 7. crash-consistent commits (the os._exit sweep is in tests/uploader/test_commit_crash.py) -------


def test_a_re_commit_interrupted_between_its_renames_is_put_back(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    old = make_checkpoint(folder, 8)
    expected = files_of(old.path)
    aside = folder / f".staging-old-{old.name}-12345"
    old.path.rename(aside)  # where commit() leaves it between its two renames
    (folder / ".staging-step-000000000008-12345").mkdir()

    clean_staging(folder)

    assert [c.step for c in list_committed(folder)] == [8] and files_of(folder / old.name) == expected
    assert not aside.exists() and newest_verified(folder) is not None


# -- 9. the first start on a new file:// remote ----------------------------------------------------


def test_listing_a_file_remote_while_its_folder_is_created_never_says_file(tmp_path: Path) -> None:
    """The start-up pull lists while the write check creates the folder: each look must be one stat."""
    root = tmp_path / "remote"
    remote = FileRemote(root)
    stop = threading.Event()

    def churn() -> None:
        while not stop.is_set():
            root.mkdir(exist_ok=True)
            root.rmdir()

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        for _ in range(20_000):
            remote.list()  # BucketNotFound ("is a file") is the race
    finally:
        stop.set()
        thread.join()
    root.write_text("a file")
    with pytest.raises(BucketNotFound, match="is a file"):
        remote.list()


def test_set_aside_remote_checkpoints_are_listed_apart(remote: Remote, local: Path) -> None:
    """`ls`, pulls and retention see only step-* prefixes; what was set aside is found by its own name."""
    push(make_checkpoint(local, 10), remote, keep=5)
    remote.copy(data_key(checkpoint_name(10), "state.pt"), "corrupt-step-000000000010-x/state.pt",
                size=(local / checkpoint_name(10) / "state.pt").stat().st_size)
    assert [c.step for c in list_remote(remote)] == [10]
    assert remote_set_aside(remote) == ["corrupt-step-000000000010-x"]

