"""Issue 18, points 2 and 5: a checkpoint written by several nodes, each with its own disk, is committed
in the bucket only once every node's part is uploaded; no reader ever takes a partial one as complete,
and the node whose part completes one deletes what it replaces. Each node is a separate local folder
pushed by its own uploader, as a node's sidecar or in-process thread would, on a folder (file://) and
on SeaweedFS.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.support.checkpoints import complete_steps, data_files_of, make_checkpoint, objects_of
from tests.support.recording import RecordingRemote
from uploader.hashing import BLOCK_SIZE
from uploader.layout import LATEST_KEY, manifest_key, node_key
from uploader.local import LocalCheckpoint, checkpoint_name, mark_finished
from uploader.exceptions import CorruptCheckpoint, ManifestError, TransientStorageError, UnsupportedFormat
from uploader.manifest import FORMAT_VERSION, Manifest
from uploader.remote import Remote
from uploader.sync import list_remote, list_set_aside, pull_files, pull_newest, push, set_aside_if_unchanged
from uploader.watch import _identity, _pending

NODES = 2
# Node 0 holds the replicated state, node 1 only its ranks' files (as a sharded save spreads them).
FILES = {0: {"state.pt": 150_000, "rank-0.bin": 20_000}, 1: {"rank-1.bin": 30_000, "rank-1b.bin": 0}}


class Killed(Exception):
    """The node died here."""


class DiesBeforeItsPart(RecordingRemote):
    """Uploads a node's data files, then the node dies before its part's manifest is written."""

    def write_bytes(self, key: str, data: bytes) -> None:
        if "/nodes/" in key:
            raise Killed(key)
        super().write_bytes(key, data)


def part(tmp_path: Path, node: int, step: int, save_id: str | None = None, format_version: int = FORMAT_VERSION
         ) -> LocalCheckpoint:
    """Node ``node``'s local part of the checkpoint of ``step`` (its own --save-folder)."""
    meta = {"node": node, "nodes": NODES, "save_id": save_id or f"save-{step}", "model": "mlp"}
    return make_checkpoint(tmp_path / f"node{node}", step, FILES[node], seed=step * 10 + node, meta=meta,
                           format_version=format_version, block_size=None if format_version == 1 else BLOCK_SIZE)


def test_the_checkpoint_is_complete_only_once_every_node_has_uploaded(remote: Remote, tmp_path: Path) -> None:
    push(part(tmp_path, 0, 10), remote, keep=3)
    assert complete_steps(remote) == []  # node 1 has not uploaded: incomplete, never pulled
    assert pull_newest(remote, tmp_path / "reader") is None

    push(part(tmp_path, 1, 10), remote, keep=3)

    assert complete_steps(remote) == [10]
    pulled = pull_newest(remote, tmp_path / "new-node")
    assert pulled is not None
    expected = {**data_files_of(tmp_path / "node0" / checkpoint_name(10)),
                **data_files_of(tmp_path / "node1" / checkpoint_name(10))}
    assert data_files_of(pulled.path) == expected
    whole = pulled.manifest()
    assert "node" not in whole.meta and whole.meta["nodes"] == NODES and whole.meta["model"] == "mlp"


@pytest.mark.parametrize("latest", [b"[" * 2100, b"not json", b'{"step": "10"}'], ids=["nested", "garbage", "str"])
def test_a_malformed_latest_is_rewritten_by_the_commit(remote: Remote, tmp_path: Path, latest: bytes) -> None:
    """``latest`` is a hint from the bucket, untrusted: 2,100 brackets raised RecursionError (exit 1)."""
    remote.write_bytes(LATEST_KEY, latest)
    push(part(tmp_path, 0, 10), remote, keep=3)
    push(part(tmp_path, 1, 10), remote, keep=3)

    assert complete_steps(remote) == [10]
    assert json.loads(remote.read_bytes(LATEST_KEY) or b"")["step"] == 10


def test_either_node_may_come_last_and_both_at_once_commit_the_same_bytes(remote: Remote, tmp_path: Path) -> None:
    push(part(tmp_path, 1, 10), remote, keep=3)
    push(part(tmp_path, 0, 10), remote, keep=3)
    first = remote.read_bytes(manifest_key(checkpoint_name(10)))

    parts = [part(tmp_path, node, 20) for node in range(NODES)]
    threads = [threading.Thread(target=push, args=(p, remote, 3)) for p in parts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert first is not None and complete_steps(remote) == [10, 20]
    committed = remote.read_bytes(manifest_key(checkpoint_name(20)))
    push(parts[1], remote, keep=3)  # a retry of an upload already done commits nothing new
    assert committed is not None and remote.read_bytes(manifest_key(checkpoint_name(20))) == committed


def test_a_node_killed_while_uploading_leaves_that_step_incomplete(remote: Remote, tmp_path: Path) -> None:
    for node in range(NODES):
        push(part(tmp_path, node, 10), remote, keep=3)
    push(part(tmp_path, 0, 20), remote, keep=3)
    dying = DiesBeforeItsPart(remote)
    with pytest.raises(Killed):
        push(part(tmp_path, 1, 20), dying, keep=3)
    assert dying.ops("put_file")  # its data went up; its part's manifest did not

    assert complete_steps(remote) == [10]
    pulled = pull_newest(remote, tmp_path / "reader")
    assert pulled is not None and pulled.step == 10


def test_parts_of_two_saves_of_one_step_are_never_mixed(remote: Remote, tmp_path: Path) -> None:
    """A re-save of step 20 after a resume: node 0's new part beside node 1's old one is not a checkpoint."""
    for node in range(NODES):
        push(part(tmp_path, node, 20, save_id="first"), remote, keep=3)
    assert complete_steps(remote) == [20]
    (tmp_path / "node0").rename(tmp_path / "node0-old")
    push(part(tmp_path, 0, 20, save_id="second"), remote, keep=3)

    assert complete_steps(remote) == []  # the first save's commit is withdrawn before anything is replaced
    (tmp_path / "node1").rename(tmp_path / "node1-old")
    push(part(tmp_path, 1, 20, save_id="second"), remote, keep=3)
    assert complete_steps(remote) == [20]
    assert Manifest.from_json(remote.read_bytes(manifest_key(checkpoint_name(20))) or b"").meta["save_id"] == "second"


def test_a_malformed_part_keeps_the_checkpoint_incomplete(remote: Remote, tmp_path: Path) -> None:
    push(part(tmp_path, 0, 10), remote, keep=3)
    remote.write_bytes(node_key(checkpoint_name(10), 1, NODES), b'{"format_version": 2, "step": "ten"}')
    push(part(tmp_path, 0, 10), remote, keep=3)
    assert complete_steps(remote) == []


@pytest.mark.parametrize("first", [0, 1])
def test_the_node_that_completes_a_checkpoint_deletes_what_it_replaces(remote: Remote, tmp_path: Path,
                                                                        first: int) -> None:
    """Node 0 alone deleted, and only when its own upload completed the checkpoint: a node 0 that was
    always first never deleted anything, and the bucket grew without bound."""
    order = (first, 1 - first)
    for node in order:
        push(part(tmp_path, node, 10), remote, keep=1)
    push(part(tmp_path, order[0], 20), remote, keep=1)  # 20 incomplete: nothing deleted
    assert complete_steps(remote) == [10]
    push(part(tmp_path, 0, 30), remote, keep=1)  # node 0's part of 30, newer: kept, never counted
    push(part(tmp_path, order[1], 20), remote, keep=1)  # completes 20: 10 goes
    assert complete_steps(remote) == [20]
    assert {c.step for c in list_remote(remote)} == {20, 30}


@pytest.mark.parametrize("newer", ["whole", "own-part"])
def test_a_node_never_replaces_a_newer_format_commit_or_part(remote: Remote, tmp_path: Path, newer: str) -> None:
    """A newer build's step 10 (its whole manifest, or this node's part) is refused, as a pull refuses it, before
    this build's re-save of step 10 deletes, overwrites or commits anything there."""
    name = checkpoint_name(10)
    for node in range(NODES):
        push(part(tmp_path, node, 10), remote, keep=3)
    key = manifest_key(name) if newer == "whole" else node_key(name, 0, NODES)
    remote.write_bytes(key, json.dumps({**json.loads(remote.read_bytes(key) or b""), "format_version": 99}).encode())
    before = objects_of(remote, name)

    with pytest.raises(UnsupportedFormat, match=f"{name}: manifest format_version 99 .*upgrade spot-trainer"):
        push(part(tmp_path, 0, 10, save_id="second"), remote, keep=3)

    assert objects_of(remote, name) == before


@pytest.mark.parametrize("older", [1, 2])
def test_parts_of_two_formats_commit_in_the_newer_one(remote: Remote, tmp_path: Path, older: int) -> None:
    """Node 0 on an older build (a rolling update, or a hand-made part): committing the parts raised a
    ValueError, exit 1 for sync and a crash loop for the sidecar at every pass (review). The newer format
    reads the older one's digests."""
    push(part(tmp_path, 0, 10, format_version=older), remote, keep=3)
    push(part(tmp_path, 1, 10), remote, keep=3)

    assert complete_steps(remote) == [10]
    pulled = pull_newest(remote, tmp_path / "reader")
    assert pulled is not None and pulled.manifest().format_version == FORMAT_VERSION


@pytest.mark.parametrize("meta", [{"node": 1, "nodes": 2}, {"node": 2, "nodes": 2, "save_id": "s"},
                                  {"node": "0", "nodes": 2, "save_id": "s"}, {"node": 0, "nodes": 2, "save_id": "a/b"}])
def test_a_part_s_node_fields_are_validated(tmp_path: Path, meta: dict) -> None:
    doc = part(tmp_path, 0, 10).manifest()
    with pytest.raises(ManifestError, match="meta"):
        Manifest.from_json(Manifest(step=10, files=doc.files, meta=meta).to_json())


def committed_whole(remote: Remote, tmp_path: Path) -> Manifest:
    """Both nodes' parts of step 10 uploaded: the whole checkpoint's manifest, as a resuming node reads it."""
    for node in range(NODES):
        push(part(tmp_path, node, 10), remote, keep=3)
    raw = remote.read_bytes(manifest_key(checkpoint_name(10)))
    assert raw is not None
    return Manifest.from_json(raw)


def test_a_node_downloads_only_the_files_it_asks_for_each_verified(remote: Remote, tmp_path: Path) -> None:
    whole = committed_whole(remote, tmp_path)
    dest = tmp_path / "scratch"
    got = pull_files(remote, whole, {"rank-1.bin", "rank-1b.bin"}, dest)
    assert got == 30_000
    assert data_files_of(dest) == data_files_of(tmp_path / "node1" / checkpoint_name(10))
    assert not (dest / "state.pt").exists()
    assert pull_files(remote, whole, {"state.pt"}, dest) == 150_000  # a second batch into the same folder
    assert (dest / "state.pt").stat().st_size == 150_000


def test_a_file_that_differs_or_is_not_listed_is_a_corrupt_checkpoint(remote: Remote, tmp_path: Path) -> None:
    whole = committed_whole(remote, tmp_path)
    with pytest.raises(CorruptCheckpoint, match="lists no 'rank-9.bin'"):
        pull_files(remote, whole, {"rank-9.bin"}, tmp_path / "a")
    key = f"{checkpoint_name(10)}/rank-1.bin"
    remote.write_bytes(key, bytes(30_000))  # same size, other bytes
    with pytest.raises(CorruptCheckpoint):
        pull_files(remote, whole, {"rank-1.bin"}, tmp_path / "b")
    assert pull_files(remote, whole, {"rank-0.bin"}, tmp_path / "c") == 20_000  # the others still verify


def test_set_aside_moves_the_failed_checkpoint_unless_it_was_saved_again(remote: Remote, tmp_path: Path) -> None:
    whole = committed_whole(remote, tmp_path)
    stale = Manifest.from_json(whole.to_json().replace(b'"mlp"', b'"other"'))
    set_aside_if_unchanged(remote, stale, "a re-save changed it meanwhile")
    assert complete_steps(remote) == [10]  # not the manifest that failed: left alone
    set_aside_if_unchanged(remote, whole, "rank-1.bin fails its sha256 check")
    assert complete_steps(remote) == []
    assert [name for name in list_set_aside(remote) if name.startswith(f"corrupt-{checkpoint_name(10)}-")]


def test_a_sidecar_uploads_the_newest_step_another_node_has_started_before_its_newest(
    remote: Remote, tmp_path: Path
) -> None:
    """Sidecars never talk to each other: each uploaded its node's newest part when free, and nodes free
    at other times completed few checkpoints. A sidecar now prefers the newest step another node has
    uploaded its part of, when it has that step too; with none such, or once the job has ended, its newest."""
    mine = [part(tmp_path, 1, step) for step in (10, 20, 30, 40)]
    push(part(tmp_path, 0, 10), remote, keep=5)
    assert _pending(tmp_path / "node1", 5, set(), set(), remote)[0] == mine[0]  # 10: node 0 is waiting for it
    push(mine[0], remote, keep=5)
    push(part(tmp_path, 0, 30), remote, keep=5)
    push(part(tmp_path, 0, 50), remote, keep=5)  # a step node 1 does not hold
    uploaded = {_identity(mine[0])}
    assert _pending(tmp_path / "node1", 5, uploaded, set(), remote)[0] == mine[2]  # 30, not 40
    mark_finished(tmp_path / "node1", 40)
    assert _pending(tmp_path / "node1", 5, uploaded, set(), remote)[0] == mine[3]  # the last goes first
    (tmp_path / "node1" / "FINISHED").unlink()
    push(mine[2], remote, keep=5)
    assert complete_steps(remote) == [10, 30]
    uploaded.add(_identity(mine[2]))
    assert _pending(tmp_path / "node1", 5, uploaded, set(), remote)[0] == mine[3]  # nothing newer started



def test_a_sidecar_uploads_a_step_another_node_started_below_a_part_left_from_an_earlier_life(
    remote: Remote, tmp_path: Path
) -> None:
    """Review 39: node 0's own disk kept its part of 700 from the life before (node 1 died before its part).
    Found in the bucket, that part became the watch's newest done, and the new life's 650, which node 1 had
    uploaded its part of, was never uploaded here: nothing the new life saved completed."""
    for node in (0, 1):
        push(part(tmp_path, node, 600), remote, keep=5)
    leftover = part(tmp_path, 0, 700)
    push(leftover, remote, keep=5)
    mine = part(tmp_path, 0, 650)
    push(part(tmp_path, 1, 650), remote, keep=5)
    assert _pending(tmp_path / "node0", 5, {_identity(leftover)}, set(), remote)[0] == mine


def test_a_sidecar_leaves_an_older_part_no_other_node_started_and_the_final_part_goes_first(
    remote: Remote, tmp_path: Path
) -> None:
    """An older part whose step no other node started would never complete: not uploaded. Once the job has
    ended its final part goes first, not a newer part (review 39: a grace-too-short save on this node alone)."""
    mine = [part(tmp_path, 1, step) for step in (300, 400)]
    assert _pending(tmp_path / "node1", 5, {_identity(mine[1])}, set(), remote) is None
    mark_finished(tmp_path / "node1", 300)
    assert _pending(tmp_path / "node1", 5, set(), set(), remote)[0] == mine[0]
    assert _pending(tmp_path / "node1", 5, set(), set(), remote, stopping=True)[0] == mine[0]


class ListingFails(RecordingRemote):
    """A bucket whose listing answers 503 (after the retries)."""

    def list(self, prefix: str = "") -> list:
        raise TransientStorageError("LIST: 503 SlowDown after 5 tries")


def test_a_sidecar_that_cannot_list_the_bucket_uploads_its_newest(remote: Remote, tmp_path: Path) -> None:
    """Which steps other nodes started is a preference: a listing that fails ended the watch."""
    mine = [part(tmp_path, 1, step) for step in (10, 20)]
    assert _pending(tmp_path / "node1", 5, set(), set(), ListingFails(remote))[0] == mine[1]
