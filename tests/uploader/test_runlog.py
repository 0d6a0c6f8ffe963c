"""The run log mirror: adds and overwrites what changed, never deletes, never follows links (issue 21)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from uploader.remote import Remote
from uploader.runlog import RUNLOG_DIR, RunlogMirror, read_ledger


def keys(remote: Remote) -> dict[str, bytes | None]:
    return {o.key: remote.read_bytes(o.key) for o in remote.list(f"{RUNLOG_DIR}/")}


def test_new_and_changed_files_go_up_and_unchanged_ones_do_not(remote: Remote, local: Path) -> None:
    ledger = local / RUNLOG_DIR / "ledger"
    ledger.mkdir(parents=True)
    (ledger / "life-a.json").write_text('{"a": 1}')
    (local / RUNLOG_DIR / "tensorboard").mkdir()
    events = local / RUNLOG_DIR / "tensorboard" / "events.out.tfevents.1"
    events.write_bytes(b"first")
    mirror = RunlogMirror(local, remote)
    assert mirror.sync() == 2
    assert keys(remote) == {"runlog/ledger/life-a.json": b'{"a": 1}', "runlog/tensorboard/events.out.tfevents.1": b"first"}
    assert mirror.sync() == 0
    with events.open("ab") as f:
        f.write(b" and more")
    assert mirror.sync() == 1
    assert keys(remote)["runlog/tensorboard/events.out.tfevents.1"] == b"first and more"


def test_links_dot_files_and_other_lives_remote_files_are_left_alone(remote: Remote, local: Path,
                                                                     tmp_path: Path) -> None:
    ledger = local / RUNLOG_DIR / "ledger"
    ledger.mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_text("not for the bucket")
    os.symlink(secret, ledger / "life-link.json")
    os.symlink(tmp_path, local / RUNLOG_DIR / "linked-dir")
    (ledger / ".life-b.json.tmp").write_text("half written")
    (ledger / "life-b.json").write_text("{}")
    remote.write_bytes("runlog/ledger/life-earlier.json", b"an earlier life, on another disk")
    assert RunlogMirror(local, remote).sync() == 1
    assert keys(remote) == {"runlog/ledger/life-b.json": b"{}",
                            "runlog/ledger/life-earlier.json": b"an earlier life, on another disk"}


def test_a_run_log_folder_that_is_a_link_is_not_followed(remote: Remote, local: Path, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "ledger").mkdir(parents=True)
    (elsewhere / "ledger" / "passwd").write_text("not for the bucket")
    local.mkdir()
    os.symlink(elsewhere, local / RUNLOG_DIR)
    assert RunlogMirror(local, remote).sync() == 0
    assert keys(remote) == {}
    assert "is not a folder (a link?); it is not uploaded" in caplog.text


def test_a_restarted_mirror_does_not_upload_again_what_is_there(remote: Remote, local: Path) -> None:
    ledger = local / RUNLOG_DIR / "ledger"
    ledger.mkdir(parents=True)
    (ledger / "life-a.json").write_text("{}")
    assert RunlogMirror(local, remote).sync() == 1
    assert RunlogMirror(local, remote).sync() == 0  # a new process: compared with the remote's listing
    (ledger / "life-a.json").write_text('{"end": "finished"}')
    assert RunlogMirror(local, remote).sync() == 1


def test_an_empty_folder_costs_no_request_and_the_ledger_reads_back(remote: Remote, local: Path) -> None:
    assert RunlogMirror(local, remote).sync() == 0
    remote.write_bytes("runlog/ledger/life-a.json", b"{}")
    remote.write_bytes("runlog/ledger/notes.txt", b"not a record")
    remote.write_bytes("runlog/ledger/life-big.json", b"x" * (2 * 1024 * 1024))
    entries = dict(read_ledger(remote))
    assert entries.keys() == {"runlog/ledger/life-a.json", "runlog/ledger/life-big.json"}
    assert len(entries["runlog/ledger/life-big.json"]) == 1024 * 1024 + 1  # only enough to refuse it
