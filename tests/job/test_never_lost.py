"""Issue 16 end to end: `job train` against corrupt checkpoints on disk and in a real bucket, a second
run on the same prefix, and storage that goes away at the end. Good work is never lost, and every
start either resumes from the newest checkpoint that verifies or stops with a documented exit code.
"""
from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support.checkpoints import corrupt_file
from tests.support.faultproxy import FaultProxy
from tests.support.jobs import REPO, ckpt_config, events, run_job, s3_job_env, train_config, train_state
from tests.support.s3server import Bucket, fast_config
from uploader.layout import data_key
from uploader.local import checkpoint_name, list_committed
from uploader.remote import Remote, open_remote
from uploader.sync import list_remote

pytestmark = [pytest.mark.slow]

ARGS = ["--seed", "9", "--log-format", "json", "--eval-interval", "1000ba", "--log-interval", "1000", "--sync-save"]
RUN_A = [*ARGS, "--max-duration", "64ba", "--save-interval", "16ba", "--keep", "3"]  # ..., 48 or so, 64 kept
RUN_B = [*ARGS, "--max-duration", "60ba", "--save-interval", "4ba", "--keep", "1"]  # ..., 56, 60


def _remote(bucket: Bucket, prefix: str = "run") -> Remote:
    return open_remote(bucket.url(prefix), fast_config(bucket.endpoint_url))


def _complete(remote: Remote) -> list[int]:
    return [c.step for c in list_remote(remote) if c.complete]


def _set_aside(folder: Path) -> list[Path]:
    return sorted(folder.glob("corrupt-step-*"))


def _remote_set_aside(remote: Remote) -> list[str]:
    return sorted({o.key.partition("/")[0] for o in remote.list("corrupt-step-")})


def _resumed(stderr: str) -> list[int]:
    return [e["step"] for e in events(stderr) if e.get("event") == "resumed"]


def _flip_remote_byte(remote: Remote, step: int) -> None:
    key = data_key(checkpoint_name(step), "state.pt")
    data = bytearray(remote.read_bytes(key) or b"")
    data[len(data) // 2] ^= 0xFF
    remote.write_bytes(key, bytes(data))


def test_a_corrupt_newest_local_checkpoint_is_set_aside_and_never_costs_the_good_ones(tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    assert run_job("train", *RUN_A, "--save-folder", str(folder)).returncode == 0
    *_, good, newest = [c.step for c in list_committed(folder)]
    assert newest == 64
    corrupt_file(folder / checkpoint_name(64) / "state.pt")

    b = run_job("train", *RUN_B, "--save-folder", str(folder))

    assert b.returncode == 0, b.stderr
    assert _resumed(b.stderr) == [good]
    assert [c.step for c in list_committed(folder)] == [60]  # the older ones pruned, 60 kept: --keep 1
    (aside,) = _set_aside(folder)
    assert aside.name.startswith("corrupt-step-000000000064-")
    again = run_job("train", *RUN_B, "--save-folder", str(folder))  # the next start resumes 60, finished
    assert again.returncode == 0, again.stderr
    assert _resumed(again.stderr) == [60]


@pytest.mark.s3
def test_a_new_node_resumes_past_a_corrupt_remote_checkpoint_and_keeps_the_good_ones(
    tmp_path: Path, s3_bucket: Bucket
) -> None:
    env, url, remote = s3_job_env(s3_bucket), s3_bucket.url("run"), _remote(s3_bucket)
    assert run_job("train", *RUN_A, "--save-folder", str(tmp_path / "a"), "--remote", url, env=env).returncode == 0
    *_, good, newest = _complete(remote)
    assert newest == 64
    _flip_remote_byte(remote, 64)

    b = run_job("train", *RUN_B, "--save-folder", str(tmp_path / "b"), "--remote", url, env=env)

    assert b.returncode == 0, b.stderr
    assert _resumed(b.stderr) == [good]
    assert _complete(remote) == [60]
    (aside,) = _remote_set_aside(remote)
    assert aside.startswith("corrupt-step-000000000064-")
    assert not any(e.get("event") == "finished" and e.get("step") != 60 for e in events(b.stderr))


@pytest.mark.s3
def test_a_bucket_whose_checkpoints_all_fail_verification_stops_start_up(tmp_path: Path, s3_bucket: Bucket) -> None:
    env, url, remote = s3_job_env(s3_bucket), s3_bucket.url("run"), _remote(s3_bucket)
    args = [*ARGS, "--max-duration", "32ba", "--save-interval", "16ba"]
    assert run_job("train", *args, "--save-folder", str(tmp_path / "a"), "--remote", url, env=env).returncode == 0
    for step in _complete(remote):
        _flip_remote_byte(remote, step)

    for attempt in ("first", "second"):  # the second start finds them set aside: still exit 6, not step 0
        done = run_job("train", *args, "--save-folder", str(tmp_path / attempt), "--remote", url, env=env)
        assert done.returncode == 6, done.stderr
        assert "none in s3://" in done.stderr and "--resume never" in done.stderr.splitlines()[-1]
        assert not any(e.get("event") == "start" for e in events(done.stderr))
    assert _complete(remote) == [] and len(_remote_set_aside(remote)) == 2  # kept, for inspection

    fresh = run_job("train", *args, "--save-folder", str(tmp_path / "c"), "--remote", url, "--resume", "never", env=env)
    assert fresh.returncode == 0, fresh.stderr  # the deliberate start-over
    assert _complete(remote) == [16, 32] and len(_remote_set_aside(remote)) == 2


@pytest.mark.s3
def test_resume_never_refuses_a_prefix_or_folder_that_holds_a_run(tmp_path: Path, s3_bucket: Bucket) -> None:
    env, url = s3_job_env(s3_bucket), s3_bucket.url("run")
    args = [*ARGS, "--max-duration", "16ba", "--save-interval", "16ba"]
    assert run_job("train", *args, "--save-folder", str(tmp_path / "a"), "--remote", url, env=env).returncode == 0

    remote_case = run_job("train", *args, "--save-folder", str(tmp_path / "b"), "--remote", url, "--resume", "never",
                          env=env)
    local_case = run_job("train", *args, "--save-folder", str(tmp_path / "a"), "--resume", "never")

    for done, needle in ((remote_case, "new --remote prefix"), (local_case, "its own --save-folder")):
        assert done.returncode == 2, done.stderr
        (line,) = [ln for ln in done.stderr.splitlines() if ln.startswith("job: error:")]
        assert needle in line and "already holds checkpoints" in line
        assert not any(e.get("event") == "start" for e in events(done.stderr))
    assert _complete(_remote(s3_bucket)) == [16]


@pytest.mark.s3
def test_a_hostile_remote_manifest_is_skipped_for_the_older_good_checkpoint(tmp_path: Path, s3_bucket: Bucket) -> None:
    """`state.pt/x` used to be committed by the pull and then fail every start with IsADirectoryError."""
    env, url, remote = s3_job_env(s3_bucket), s3_bucket.url("run"), _remote(s3_bucket)
    args = [*ARGS, "--max-duration", "32ba", "--save-interval", "16ba"]
    assert run_job("train", *args, "--save-folder", str(tmp_path / "a"), "--remote", url, env=env).returncode == 0
    name = checkpoint_name(32)
    remote.write_bytes(f"{name}/state.pt/x", remote.read_bytes(f"{name}/state.pt") or b"")  # it verifies
    doc = json.loads(remote.read_bytes(f"{name}/manifest.json") or b"")
    doc["files"][0]["path"] = "state.pt/x"
    remote.write_bytes(f"{name}/manifest.json", json.dumps(doc).encode())

    done = run_job("train", *args, "--save-folder", str(tmp_path / "b"), "--remote", url, env=env)

    assert done.returncode == 0, done.stderr
    assert _resumed(done.stderr) == [16]


@pytest.mark.s3
def test_a_final_upload_that_cannot_finish_ends_with_exit_5_and_the_checkpoint_kept(
    spawn, tmp_path: Path, s3_bucket: Bucket, fault_proxy: FaultProxy
) -> None:
    env = {**s3_job_env(s3_bucket), "JOB_ENDPOINT_URL": fault_proxy.endpoint_url}
    folder = tmp_path / "ck"
    proc = spawn("train", *ARGS, "--model", "tests.support.slow_model:build", "--max-duration", "150ba",
                 "--save-interval", "1000ba", "--save-folder", str(folder), "--remote", s3_bucket.url("run"),
                 "--final-upload-timeout", "3", env=env)
    proc.wait_event("start", timeout=60)
    fault_proxy.slow_down(10**9)  # the storage answers 503 to everything from now on

    assert proc.wait(timeout=90) == 5, proc.stderr
    assert "--final-upload-timeout" in proc.stderr.splitlines()[-1]
    assert [c.step for c in list_committed(folder)] == [150]  # kept for the next start or a sidecar


def test_retention_is_frozen_once_the_job_names_the_checkpoint_it_keeps(tmp_path: Path) -> None:
    """The `preempted` event names a checkpoint; a write that commits after it must not prune that one."""
    from job.checkpoint import Checkpointer

    state = train_state(train_config(max_duration="4ba"), ckpt_config(tmp_path / "unused"))
    checkpointer = Checkpointer(tmp_path / "ck", keep=1, meta={})
    checkpointer.save(state)
    checkpointer.freeze_retention()
    state.timer.on_batch_complete(samples=64)  # a later step
    checkpointer.save(state)
    assert [c.step for c in list_committed(tmp_path / "ck")] == [4, 5]


def test_torch_is_required_where_weights_only_loading_is_safe() -> None:
    """weights_only=True can be bypassed before torch 2.6 (CVE-2025-32434)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (torch,) = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch"]
    assert not torch.specifier.contains(Version("2.5.1")) and torch.specifier.contains(Version("2.6.0"))


@pytest.mark.parametrize(("flags", "code"), [
    (["--endpoint-url", "ftp://user:s3cr3t@127.0.0.1:9/"], 2),  # refused by the upload config
    (["--remote", "s3://user:s3cr3t@bucket/run"], 2),  # not a bucket name
    (["--spot-notice", "aws", "--spot-endpoint", "http://user:s3cr3t@127.0.0.1:9/?token=s3cr3t"], 0),  # polls fail
], ids=["endpoint", "remote", "spot-endpoint"])
def test_urls_with_credentials_never_reach_the_job_s_output(tmp_path: Path, flags: list[str], code: int) -> None:
    done = run_job("train", *ARGS, "--max-duration", "1ba", "--save-folder", str(tmp_path / "ck"), *flags)
    assert done.returncode == code, done.stderr
    assert "s3cr3t" not in done.stderr + done.stdout
    assert "***" in done.stderr or code == 0


def test_the_job_s_log_lines_redact_urls_in_any_text() -> None:
    import logging

    from job.logs import JsonFormatter, TextFormatter

    record = logging.LogRecord("botocore", logging.WARNING, __file__, 1, "Could not connect to %s", (
        '"http://user:s3cr3t@127.0.0.1:9/b?list-type=2&X-Amz-Signature=s3cr3t"',), None)
    for formatter in (JsonFormatter(), TextFormatter()):
        line = formatter.format(record)
        assert "s3cr3t" not in line and "http://***@127.0.0.1:9/b?***" in line
