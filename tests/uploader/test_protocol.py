"""The commit protocol (push, pull, retention, resume), run against both a file:// and an S3 remote."""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.support.checkpoints import (
    SMALL_FILES,
    WITH_LARGE_FILE,
    complete_steps,
    corrupt_file,
    data_files_of,
    make_checkpoint,
    objects_of,
)
from tests.support.disk import NO_SPACE, fake_fallocate, fill_disk_after, pull_refused
from tests.support.recording import RecordingRemote
from uploader import destination
from uploader.exceptions import CorruptCheckpoint, LocalWriteError, UnsupportedFormat
from uploader.filesystem import FileRemote
from uploader.layout import LATEST_KEY, data_key, latest_document, manifest_key
from uploader.local import STAGING_PREFIX, LocalCheckpoint, checkpoint_name, list_committed, list_set_aside, newest_verified
from uploader.remote import Remote
from uploader.sync import list_remote, newest_complete, pull_newest, push, push_all
from uploader.sync import list_set_aside as remote_set_aside


def xattrs_supported(folder: Path) -> bool:
    probe = folder / "xattr-probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.probe", b"1")
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def fail_push_half_way(ckpt: LocalCheckpoint, remote: Remote, keep: int) -> bytes:
    """Push with one file corrupted locally: the files before it go up, then the push refuses.
    Returns the original bytes so the caller can repair the file."""
    victim = ckpt.path / "rng/state.bin"
    original = victim.read_bytes()
    corrupt_file(victim)
    with pytest.raises(CorruptCheckpoint):
        push(ckpt, remote, keep=keep)
    return original


def push_two(remote: Remote, local: Path, newest_files: Mapping[str, int] = SMALL_FILES) -> LocalCheckpoint:
    """Steps 100 and 200 in the remote, as the job leaves them; returns step 200."""
    push(make_checkpoint(local, 100), remote, keep=3)
    newest = make_checkpoint(local, 200, newest_files)
    push(newest, remote, keep=3)
    return newest


def rewrite_manifest(remote: Remote, ckpt: LocalCheckpoint, edit: Callable[[dict[str, Any]], None]) -> None:
    """Replace the remote manifest of ``ckpt`` by an edited copy (damage, or a newer build's)."""
    doc = json.loads(remote.read_bytes(manifest_key(ckpt.name)) or b"")
    edit(doc)
    remote.write_bytes(manifest_key(ckpt.name), json.dumps(doc).encode())


def test_round_trip_is_byte_identical_and_a_normal_local_checkpoint(remote: Remote, local: Path, restore: Path) -> None:
    ckpt = make_checkpoint(local, 120, WITH_LARGE_FILE)
    push(ckpt, remote, keep=3)

    pulled = pull_newest(remote, restore)

    assert pulled is not None and pulled.step == 120 and pulled.name == ckpt.name
    assert data_files_of(pulled.path) == data_files_of(ckpt.path)
    assert pulled.manifest() == ckpt.manifest()
    assert list_committed(restore) == [pulled]
    assert not [p for p in restore.iterdir() if p.name.startswith(STAGING_PREFIX)]


@pytest.mark.parametrize(("block_size", "format_version"), [(None, 1), (768 * 1024, 2)],
                         ids=["format-1", "format-2-blocks-not-dividing-parts"])
def test_each_format_round_trips_and_a_flipped_byte_in_a_large_file_is_caught(
    remote: Remote, local: Path, restore: Path, block_size: int | None, format_version: int
) -> None:
    """768 KiB blocks do not divide the 5 MiB parts: ranges and parts are rounded up to whole blocks."""
    push(make_checkpoint(local, 100), remote, keep=3)
    ckpt = make_checkpoint(local, 200, WITH_LARGE_FILE, block_size=block_size, format_version=format_version)
    push(ckpt, remote, keep=3)

    pulled = pull_newest(remote, restore)

    assert pulled is not None and pulled.step == 200
    assert data_files_of(pulled.path) == data_files_of(ckpt.path)
    assert pulled.manifest() == ckpt.manifest() and pulled.manifest().format_version == format_version

    key = data_key(ckpt.name, "big.bin")
    damaged = bytearray(remote.read_bytes(key) or b"")
    damaged[6 * 1024 * 1024 + 1] ^= 0x01  # inside the second range of the download
    remote.write_bytes(key, bytes(damaged))
    again = pull_newest(remote, restore / "again")
    assert again is not None and again.step == 100


def test_remote_layout_has_manifest_and_latest(remote: Remote, local: Path) -> None:
    push(make_checkpoint(local, 7), remote, keep=3)
    name = checkpoint_name(7)

    keys = {o.key for o in remote.list()}

    assert keys == {data_key(name, p) for p in SMALL_FILES} | {manifest_key(name), LATEST_KEY}
    assert json.loads(remote.read_bytes(LATEST_KEY) or b"") == {"name": name, "step": 7}


def test_pull_of_a_step_already_verified_locally_downloads_nothing(remote: Remote, local: Path, restore: Path) -> None:
    push(make_checkpoint(local, 5), remote, keep=3)
    first = pull_newest(remote, restore)
    recording = RecordingRemote(remote)

    again = pull_newest(recording, restore)

    assert again == first
    assert recording.ops("get_file") == []


def test_resumed_upload_skips_files_already_uploaded(remote: Remote, local: Path) -> None:
    if isinstance(remote, FileRemote) and not xattrs_supported(local.parent):
        pytest.skip("this file system has no user xattrs: a file:// resume re-copies everything")
    ckpt = make_checkpoint(local, 3)
    original = fail_push_half_way(ckpt, remote, keep=3)
    (ckpt.path / "rng/state.bin").write_bytes(original)
    recording = RecordingRemote(remote)

    push(ckpt, recording, keep=3)

    assert recording.ops("put_file") == [data_key(ckpt.name, "rng/state.bin"), data_key(ckpt.name, "empty")]
    assert complete_steps(remote) == [3]


def test_an_interrupted_push_is_incomplete_and_never_pulled(remote: Remote, local: Path, restore: Path) -> None:
    push(make_checkpoint(local, 1), remote, keep=3)
    newer = make_checkpoint(local, 2)
    fail_push_half_way(newer, remote, keep=3)

    by_step = {c.step: c for c in list_remote(remote)}
    pulled = pull_newest(remote, restore)

    assert by_step[1].complete and not by_step[2].complete
    assert newest_complete(remote) is not None and newest_complete(remote)[0] == 1  # type: ignore[index]
    assert pulled is not None and pulled.step == 1


def test_retention_deletes_only_after_a_newer_commit_and_manifest_first(remote: Remote, local: Path) -> None:
    for step in (1, 2):
        push(make_checkpoint(local, step), remote, keep=2)
    third = make_checkpoint(local, 3)
    original = fail_push_half_way(third, remote, keep=2)
    assert complete_steps(remote) == [1, 2]  # the failed commit of 3 deleted nothing

    (third.path / "rng/state.bin").write_bytes(original)
    recording = RecordingRemote(remote)
    push(third, recording, keep=2)

    assert complete_steps(remote) == [2, 3]
    assert {c.step for c in list_remote(remote)} == {2, 3}
    deletes = recording.ops("delete")
    assert deletes[0] == [manifest_key(checkpoint_name(1))]
    assert {k for batch in deletes[1:] for k in batch} == {data_key(checkpoint_name(1), p) for p in SMALL_FILES}


def test_push_all_uploads_only_what_is_missing_and_would_be_kept(remote: Remote, local: Path) -> None:
    ckpts = [make_checkpoint(local, step) for step in (1, 2, 3, 4)]
    push(ckpts[2], remote, keep=3)

    pushed = push_all(local, remote, keep=3)

    assert pushed == [2, 4]
    assert complete_steps(remote) == [2, 3, 4]


def test_push_all_skips_a_corrupt_local_checkpoint(remote: Remote, local: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    damaged = make_checkpoint(local, 1)
    make_checkpoint(local, 2)
    corrupt_file(damaged.path / "state.pt")

    with caplog.at_level(logging.WARNING, logger="uploader"):
        pushed = push_all(local, remote, keep=3)

    assert pushed == [2] and complete_steps(remote) == [2]
    assert f"skipping corrupt checkpoint {damaged.path}" in caplog.text
    # Set aside, kept for inspection: never listed, chosen, uploaded or pruned again.
    assert [c.step for c in list_committed(local)] == [2]
    (aside,) = list_set_aside(local)
    assert aside.name.startswith(f"corrupt-{damaged.name}-") and (aside / "state.pt").is_file()


@pytest.mark.parametrize("hostile", ["../../escape-{token}", "../../../escape-{token}", "sub/../../../escape-{token}",
                                     "{tmp}/abs-escape-{token}"])
def test_hostile_manifest_is_refused_and_nothing_is_written_outside(
    remote: Remote, local: Path, restore: Path, tmp_path: Path, hostile: str, caplog: pytest.LogCaptureFixture
) -> None:
    push(make_checkpoint(local, 100), remote, keep=3)
    token = uuid.uuid4().hex
    path = hostile.format(token=token, tmp=tmp_path)
    evil = make_checkpoint(tmp_path / "evil", 200).manifest()
    doc = json.loads(evil.to_json())
    doc["files"][0]["path"] = path
    remote.write_bytes(manifest_key(checkpoint_name(200)), json.dumps(doc).encode())

    with caplog.at_level(logging.WARNING, logger="uploader.sync"):
        pulled = pull_newest(remote, restore)

    assert pulled is not None and pulled.step == 100
    assert "unsafe file name" in caplog.text
    assert list(tmp_path.parent.glob(f"**/*{token}*")) == []
    assert [c.step for c in list_committed(restore)] == [100]


def test_corrupt_remote_checkpoint_is_skipped_for_the_previous_one(
    remote: Remote, local: Path, restore: Path, caplog: pytest.LogCaptureFixture
) -> None:
    newest = push_two(remote, local)
    damaged = bytearray(remote.read_bytes(data_key(newest.name, "state.pt")) or b"")
    damaged[0] ^= 0xFF
    remote.write_bytes(data_key(newest.name, "state.pt"), bytes(damaged))

    with caplog.at_level(logging.WARNING, logger="uploader.sync"):
        pulled = pull_newest(remote, restore)

    assert pulled is not None and pulled.step == 100
    assert "fails its blake3 check" in caplog.text and newest.name in caplog.text
    assert [c.step for c in list_committed(restore)] == [100]
    assert not [p for p in restore.iterdir() if p.name.startswith(STAGING_PREFIX)]


def full_disk_message(ckpt: LocalCheckpoint, folder: Path) -> str:
    return pull_refused(ckpt.name, ckpt.manifest().total_size, folder, NO_SPACE)


def test_a_disk_that_fills_up_during_a_pull_is_one_clear_error_and_loses_nothing(
    remote: Remote, local: Path, restore: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a network failure, not a corrupt checkpoint (nothing is set aside), not an older checkpoint
    instead: the newest one is what the job needs, and the disk is what must change."""
    newest = push_two(remote, local, WITH_LARGE_FILE)
    written = fill_disk_after(monkeypatch, 3 * 1024 * 1024)

    with pytest.raises(LocalWriteError) as raised:
        pull_newest(remote, restore)

    assert str(raised.value) == full_disk_message(newest, restore)
    assert 0 < sum(written) <= 3 * 1024 * 1024
    assert list(restore.iterdir()) == []  # the part it had written is given back
    assert complete_steps(remote) == [100, 200] and remote_set_aside(remote) == []
    monkeypatch.undo()
    pulled = pull_newest(remote, restore)
    assert pulled is not None and data_files_of(pulled.path) == data_files_of(newest.path)


def test_a_disk_too_small_for_a_file_fails_before_a_byte_of_it_is_written(
    remote: Remote, local: Path, restore: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    newest = make_checkpoint(local, 300, WITH_LARGE_FILE)
    push(newest, remote, keep=3)
    call, asked = fake_fallocate(errno.ENOSPC)
    monkeypatch.setattr(destination, "_fallocate", call)
    written = fill_disk_after(monkeypatch, 1 << 40)  # room enough: only counts

    with pytest.raises(LocalWriteError) as raised:
        pull_newest(remote, restore)

    assert str(raised.value) == full_disk_message(newest, restore)
    assert asked == [next(f.size for f in newest.manifest().files if f.size)] and written == []
    assert list(restore.iterdir()) == [] and complete_steps(remote) == [300]


def test_a_folder_that_cannot_be_written_is_named_with_what_to_do(remote: Remote, local: Path, tmp_path: Path) -> None:
    ckpt = make_checkpoint(local, 100)
    push(ckpt, remote, keep=3)
    (tmp_path / "a-file").write_text("")
    folder = tmp_path / "a-file" / "ck"

    with pytest.raises(LocalWriteError) as raised:
        pull_newest(remote, folder)

    assert str(raised.value) == pull_refused(ckpt.name, ckpt.manifest().total_size, folder,
                                             "Not a directory; use a folder this process can write")
    assert complete_steps(remote) == [100]


def test_a_manifest_claiming_more_bytes_than_stored_is_a_corrupt_checkpoint_not_a_full_disk(
    remote: Remote, local: Path, restore: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The size is checked against the stored object before the manifest's size is reserved."""
    newest = push_two(remote, local)
    rewrite_manifest(remote, newest, lambda doc: doc["files"][0].update(size=1 << 50))

    with caplog.at_level(logging.WARNING, logger="uploader.sync"):
        pulled = pull_newest(remote, restore)

    assert pulled is not None and pulled.step == 100
    assert f"the manifest says {1 << 50}" in caplog.text


def test_a_real_disk_too_small_refuses_the_checkpoint_before_writing_a_byte_and_an_older_one_fits(
    remote: Remote, local: Path, small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 MiB of room and an 11 MiB file, listed last: the kernel's ENOSPC comes from the reservation made
    for the whole checkpoint, so not even the files that would fit are fetched or written; an explicitly
    asked-for older checkpoint that fits still pulls."""
    older = make_checkpoint(local, 100)
    push(older, remote, keep=3)
    newest = make_checkpoint(local, 200, WITH_LARGE_FILE)
    push(newest, remote, keep=3)
    written = fill_disk_after(monkeypatch, 1 << 40)  # the disk is real here: this only counts
    folder = small_disk / "ck"

    with pytest.raises(LocalWriteError) as raised:
        pull_newest(remote, folder)

    assert str(raised.value) == full_disk_message(newest, folder)
    assert written == []  # not even the four small files listed before big.bin
    assert list(folder.iterdir()) == []
    pulled = pull_newest(remote, folder, step=100)
    assert pulled is not None and data_files_of(pulled.path) == data_files_of(older.path)


def dead_pid() -> int:
    """The id of a process that has ended (reaped: the kernel has no such process any more)."""
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(child.stdout)


def test_a_killed_pulls_reserved_room_is_given_back_to_the_next_pull(
    remote: Remote, local: Path, small_disk: Path
) -> None:
    """A pull killed early holds its whole checkpoint's room (reserved up front); on a disk sized for one
    checkpoint the next pull would fail for ever unless that staging folder goes."""
    newest = make_checkpoint(local, 200, {"state.pt": 3 * 1024 * 1024})
    push(newest, remote, keep=3)
    folder = small_disk / "ck"
    abandoned = folder / f"{STAGING_PREFIX}{newest.name}-{dead_pid()}"
    abandoned.mkdir(parents=True)
    (abandoned / "state.pt").write_bytes(bytes(6 * 1024 * 1024))  # 6 + 3 MiB do not fit in 8
    alive = folder / f"{STAGING_PREFIX}{newest.name}-{os.getppid()}"  # a pull still running: not touched
    alive.mkdir()
    other_step = folder / f"{STAGING_PREFIX}{checkpoint_name(100)}-{dead_pid()}"  # not this pull's to judge
    other_step.mkdir()

    pulled = pull_newest(remote, folder)

    assert pulled is not None and data_files_of(pulled.path) == data_files_of(newest.path)
    assert not abandoned.exists() and alive.is_dir() and other_step.is_dir()


def test_a_listing_that_misses_a_file_is_asked_again_not_taken_for_damage(
    remote: Remote, local: Path, restore: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file:// listing skips a folder it cannot read; an S3-compatible one may lag. Before a checkpoint
    is called corrupt (and set aside), each file the listing does not confirm is looked up itself."""
    newest = make_checkpoint(local, 200)
    push(newest, remote, keep=3)
    listed = remote.list
    monkeypatch.setattr(remote, "list", lambda prefix="": [o for o in listed(prefix) if not o.key.endswith("optim.pt")])

    pulled = pull_newest(remote, restore)

    assert pulled is not None and data_files_of(pulled.path) == data_files_of(newest.path)
    assert remote_set_aside(remote) == []


def test_a_remote_checkpoint_of_a_newer_format_is_refused_not_skipped(remote: Remote, local: Path, restore: Path) -> None:
    """An older build must not pull the previous checkpoint and then upload over the newer one."""
    newest = push_two(remote, local)
    rewrite_manifest(remote, newest, lambda doc: doc.update(format_version=99))

    for look in (lambda: pull_newest(remote, restore), lambda: newest_complete(remote)):
        with pytest.raises(UnsupportedFormat, match=f"{newest.name}: manifest format_version 99 .*upgrade spot-trainer"):
            look()
    assert list_committed(restore) == []
    assert complete_steps(remote) == [100, 200]


def test_an_upload_never_replaces_a_remote_checkpoint_of_a_newer_format(remote: Remote, local: Path) -> None:
    """Review B, 05: `pull` refused it, but `sync` deleted its manifest and put this build's in its place. Refused
    as a pull refuses it, before anything remote is deleted or written, and the local checkpoint is kept."""
    newest = push_two(remote, local)
    rewrite_manifest(remote, newest, lambda doc: doc.update(format_version=99))
    before = objects_of(remote, newest.name)

    refused = f"{remote.url}/{newest.name}: manifest format_version 99 .*upgrade spot-trainer"
    for upload in (lambda: push(newest, remote, keep=1), lambda: push_all(local, remote, keep=1)):
        with pytest.raises(UnsupportedFormat, match=refused):
            upload()

    assert objects_of(remote, newest.name) == before
    assert complete_steps(remote) == [100, 200]
    assert [c.step for c in list_committed(local)] == [100, 200] and list_set_aside(local) == []


def test_a_local_checkpoint_of_a_newer_format_is_skipped_by_uploads_never_set_aside(
    remote: Remote, local: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_checkpoint(local, 100)
    newest = make_checkpoint(local, 200)
    manifest = newest.path / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 99}))

    with caplog.at_level(logging.WARNING, logger="uploader.sync"):
        assert push_all(local, remote, keep=3) == [100]

    assert f"skipping local {newest.name}: " in caplog.text and "upgrade spot-trainer" in caplog.text
    assert [c.step for c in list_committed(local)] == [100, 200] and list_set_aside(local) == []
    assert complete_steps(remote) == [100]


def test_a_local_checkpoint_of_a_newer_format_is_refused_not_skipped(local: Path) -> None:
    make_checkpoint(local, 100)
    newest = make_checkpoint(local, 200)
    manifest = newest.path / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format_version": 99}))

    with pytest.raises(UnsupportedFormat, match=f"{newest.path}: manifest format_version 99"):
        newest_verified(local)


def test_pull_from_an_empty_remote_returns_none(remote: Remote, restore: Path) -> None:
    assert pull_newest(remote, restore) is None
    assert newest_complete(remote) is None
    assert list_remote(remote) == []


def test_a_different_save_of_the_same_step_replaces_the_remote_one(remote: Remote, local: Path, restore: Path) -> None:
    push(make_checkpoint(local, 9, seed=1), remote, keep=3)
    resaved = make_checkpoint(local, 9, seed=2)  # e.g. re-saved after a resume

    push(resaved, remote, keep=3)
    pulled = pull_newest(remote, restore)

    assert pulled is not None and data_files_of(pulled.path) == data_files_of(resaved.path)


def test_pull_does_not_trust_a_stale_latest(remote: Remote, local: Path, restore: Path) -> None:
    for step in (1, 2):
        push(make_checkpoint(local, step), remote, keep=3)
    remote.write_bytes(LATEST_KEY, json.dumps({"name": checkpoint_name(999), "step": 999}).encode())

    pulled = pull_newest(remote, restore)

    assert pulled is not None and pulled.step == 2


def latest_step(remote: Remote) -> int:
    return json.loads(remote.read_bytes(LATEST_KEY) or b"")["step"]


def test_latest_never_goes_back_to_an_older_step(remote: Remote, tmp_path: Path) -> None:
    """Review B, R3: a sync of an older copy of step 100 (another node's disk, a snapshot) found it already
    there, uploaded nothing, and still pointed ``latest`` back at 100; an older step uploaded did too."""
    x, y = tmp_path / "x", tmp_path / "y"
    for step in (100, 200):
        make_checkpoint(x, step)
    push_all(x, remote, keep=3)
    assert latest_step(remote) == 200

    shutil.copytree(x / checkpoint_name(100), y / checkpoint_name(100))
    assert push_all(y, remote, keep=3) == []  # nothing uploaded: latest not touched
    assert latest_step(remote) == 200
    push(make_checkpoint(y, 150), remote, keep=3)  # an older step uploaded: not taken back either
    assert latest_step(remote) == 200
    push(make_checkpoint(y, 300), remote, keep=3)
    assert latest_step(remote) == 300


def test_latest_never_names_a_checkpoint_the_same_pass_deleted(remote: Remote, tmp_path: Path) -> None:
    """Review 39: an uploader died between 400's manifest and ``latest`` (still 300); the next pass found 400
    there (nothing uploaded: latest left alone), then its retention (keep 1) deleted 300."""
    push(make_checkpoint(tmp_path, 300), remote, keep=3)
    push(make_checkpoint(tmp_path, 400), remote, keep=3)
    remote.write_bytes(LATEST_KEY, latest_document(300))
    assert push_all(tmp_path, remote, keep=1) == []
    assert complete_steps(remote) == [400] and latest_step(remote) == 400


def test_a_latest_naming_a_step_that_is_gone_names_the_newest_complete_one(remote: Remote, tmp_path: Path) -> None:
    """Nothing uploaded leaves ``latest`` alone, unless the step it names is no more (moved away by hand, set
    aside): then the newest complete one is right, not the older step just found already there."""
    x, y = tmp_path / "x", tmp_path / "y"
    for step in (100, 200, 300, 400):
        push(make_checkpoint(x, step), remote, keep=4)
    remote.delete([manifest_key(checkpoint_name(400))])
    shutil.copytree(x / checkpoint_name(100), y / checkpoint_name(100))

    assert push_all(y, remote, keep=4) == []
    assert latest_step(remote) == 300
