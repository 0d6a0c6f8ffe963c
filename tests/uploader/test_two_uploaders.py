"""Two uploaders on one prefix (two `uploader watch` on one shared folder, a hand-run `uploader sync` beside a
sidecar): one's retention must never leave the other's checkpoint complete without its data."""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.checkpoints import complete_steps, make_checkpoint
from tests.support.faultproxy import FaultProxy
from tests.support.polling import wait_until
from tests.support.s3server import Bucket, fast_config
from uploader.exceptions import DataVanished
from uploader.filesystem import FileRemote
from uploader.layout import data_key, manifest_key
from uploader.local import checkpoint_name
from uploader.remote import open_remote
from uploader.sync import list_remote, pull_newest, push, push_all


def test_retention_leaves_another_uploaders_upload_in_flight_alone(
    fault_proxy: FaultProxy, s3_bucket: Bucket, tmp_path: Path
) -> None:
    """A has uploaded step 100's data, its manifest PUT in flight; B uploads 200 with keep 1. B's retention took
    100 for a dead upload and deleted its data; A's manifest then landed: step 100 complete, without data."""
    local, name = tmp_path / "local", checkpoint_name(100)
    direct = open_remote(s3_bucket.url(), fast_config(s3_bucket.endpoint_url))
    slow = open_remote(s3_bucket.url(), fast_config(fault_proxy.endpoint_url))
    fault_proxy.hold(f"/{name}/manifest.json", after=1)  # the first is the GET that looks for a remote copy
    with ThreadPoolExecutor(1) as pool:
        uploading = pool.submit(push, make_checkpoint(local, 100), slow, 1)
        try:
            wait_until(lambda: fault_proxy.counters.held > 0, what="A's manifest PUT of step 100 in flight")
            push(make_checkpoint(local, 200), direct, keep=1)
        finally:
            fault_proxy.passthrough()
        uploading.result(timeout=60)

    assert complete_steps(direct) == [100, 200]
    pulled = pull_newest(direct, tmp_path / "restore", step=100, set_aside_corrupt=False)
    assert pulled is not None and pulled.step == 100  # every file there, verified byte for byte


def test_an_upload_whose_data_vanished_writes_no_manifest_and_is_not_reported(
    fault_proxy: FaultProxy, s3_bucket: Bucket, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Another uploader's retention deletes a file already up while the last one is in flight: the manifest
    is not written (no complete checkpoint without its data), the step is not reported uploaded, and the next
    pass uploads what is missing."""
    local, name = tmp_path / "local", checkpoint_name(100)
    ckpt = make_checkpoint(local, 100)
    files = ckpt.manifest().files
    direct = open_remote(s3_bucket.url(), fast_config(s3_bucket.endpoint_url))
    slow = open_remote(s3_bucket.url(), fast_config(fault_proxy.endpoint_url))
    fault_proxy.hold(f"PUT /{s3_bucket.name}/ckpt/{name}/{files[-1].path}")
    with ThreadPoolExecutor(1) as pool, caplog.at_level(logging.INFO):
        syncing = pool.submit(push_all, local, slow, 3)
        try:
            wait_until(lambda: fault_proxy.counters.held > 0, what="the last data file's PUT in flight")
            direct.delete([data_key(name, files[0].path)])  # what another uploader's retention does
        finally:
            fault_proxy.passthrough()
        with pytest.raises(DataVanished, match=f"{name} on {slow.url}: {files[0].path} vanished after being uploaded"):
            syncing.result(timeout=60)  # a one-shot sync says so (exit 5): no next pass of its own uploads it

    assert direct.head(manifest_key(name)) is None
    assert push_all(local, direct, 3) == [100]  # the next pass
    pulled = pull_newest(direct, tmp_path / "restore", set_aside_corrupt=False)
    assert pulled is not None and pulled.step == 100


def test_retention_deletes_a_dead_upload_once_it_is_old(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A young incomplete checkpoint may be another uploader's in flight: kept. Once older than
    uploader.sync.YOUNG_UPLOAD_S (a day is) next to the checkpoint just uploaded, it is a dead upload,
    deleted by the next pass: never kept forever."""
    root, local = tmp_path / "remote", tmp_path / "local"
    remote = FileRemote(root)
    push(make_checkpoint(local, 100), remote, keep=3)
    remote.write_bytes(data_key(checkpoint_name(150), "state.pt"), b"half an upload")
    with caplog.at_level(logging.INFO):
        push(make_checkpoint(local, 200), remote, keep=3)
    assert {c.step: c.complete for c in list_remote(remote)} == {100: True, 150: False, 200: True}
    assert f"retention: keeping incomplete {checkpoint_name(150)}" in caplog.text

    old = time.time() - 24 * 3600
    for path in (root / checkpoint_name(150)).rglob("*"):
        os.utime(path, (old, old))
    push(make_checkpoint(local, 300), remote, keep=3)
    assert {c.step: c.complete for c in list_remote(remote)} == {100: True, 200: True, 300: True}


def test_data_deleted_between_the_check_and_the_manifest_takes_the_manifest_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 39: a resumed upload whose files were all there long since (so no longer a young upload) listed
    them, then another uploader's retention deleted them before its manifest landed: complete, without data.
    The listing after the manifest finds it and deletes the manifest again."""
    remote = open_remote(f"file://{tmp_path / 'remote'}", fast_config())
    ckpt = make_checkpoint(tmp_path / "local", 100)
    first_file = data_key(ckpt.name, ckpt.manifest().files[0].path)
    real_write = FileRemote.write_bytes

    def write_after_a_retention(self: FileRemote, key: str, data: bytes) -> None:
        if key == manifest_key(ckpt.name):
            self.delete([first_file])  # another uploader's retention, right between the check and the write
        real_write(self, key, data)

    monkeypatch.setattr(FileRemote, "write_bytes", write_after_a_retention)
    with pytest.raises(DataVanished):
        push(ckpt, remote, keep=3)
    assert remote.head(manifest_key(ckpt.name)) is None and complete_steps(remote) == []
