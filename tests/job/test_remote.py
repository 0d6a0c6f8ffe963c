"""`job train --remote` against the real S3 server: resume from the bucket, upload in-process or by sidecar."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys

import pytest

from tests.support.disk import FILE_TOO_LARGE, limit_file_size, pull_refused
from tests.support.jobs import REPO, events, inspect, run_job, s3_job_env
from tests.support.polling import wait_until
from tests.support.s3server import READER, Credentials, fast_config
from uploader import local
from uploader.remote import open_remote
from uploader.sync import list_remote, list_set_aside

pytestmark = [pytest.mark.s3, pytest.mark.slow]

ARGS = ["--max-duration", "120ba", "--eval-interval", "40ba", "--seed", "9", "--log-format", "json",
        "--save-interval", "10ba", "--log-interval", "5"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    done = run_job("train", *ARGS, "--save-folder", str(folder))
    assert done.returncode == 0, done.stderr
    return inspect(folder)


def remote_steps(bucket, prefix: str = "run") -> list[int]:
    remote = open_remote(bucket.url(prefix), fast_config(bucket.endpoint_url))
    try:
        return [c.step for c in list_remote(remote) if c.complete]
    finally:
        remote.close()


def test_sigkilled_job_resumes_from_the_bucket_on_a_new_machine(spawn, tmp_path, s3_bucket, uninterrupted):
    env, remote = s3_job_env(s3_bucket), s3_bucket.url("run")
    folder = tmp_path / "ck"
    proc = spawn("train", *ARGS, "--save-folder", str(folder), "--remote", remote, env=env)
    wait_until(lambda: any(s >= 30 for s in remote_steps(s3_bucket)), timeout=120, what="step 30 in the bucket")
    proc.kill()  # SIGKILL: no final checkpoint, no goodbye
    shutil.rmtree(folder)  # a new machine: the local disk is gone

    done = run_job("train", *ARGS, "--save-folder", str(folder), "--remote", remote, env=env)
    assert done.returncode == 0, done.stderr
    resumed = [json.loads(line) for line in done.stderr.splitlines() if '"resumed"' in line]
    assert len(resumed) == 1 and resumed[0]["source"].startswith(remote + "/step-") and resumed[0]["step"] >= 30
    assert inspect(folder)["model_sha256"] == uninterrupted["model_sha256"]
    assert max(remote_steps(s3_bucket)) == 120
    remote_info = json.loads(run_job("inspect", remote, env=env).stdout)
    assert (remote_info["step"], remote_info["model_sha256"]) == (120, uninterrupted["model_sha256"])


def test_remote_newer_than_local_wins(tmp_path, s3_bucket):
    env, remote = s3_job_env(s3_bucket), s3_bucket.url("run")
    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    assert run_job("train", *ARGS, "--max-duration", "20ba", "--save-folder", str(stale)).returncode == 0
    assert run_job("train", *ARGS, "--max-duration", "40ba", "--save-folder", str(fresh), "--remote", remote,
                   env=env).returncode == 0
    done = run_job("train", *ARGS, "--max-duration", "40ba", "--save-folder", str(stale), "--remote", remote, env=env)
    assert done.returncode == 0, done.stderr
    assert '"source": "%s/step-000000000040"' % remote in done.stderr


def test_a_corrupt_newest_local_checkpoint_is_pulled_again_from_the_bucket(tmp_path, s3_bucket):
    # Pulls are not fsynced (the bucket holds the durable copy): one torn by a power cut is a corrupt
    # newest local checkpoint whose step the bucket also has. The job must take the bucket's, not an
    # older local one.
    env, remote, folder = s3_job_env(s3_bucket), s3_bucket.url("torn"), tmp_path / "ck"
    assert run_job("train", *ARGS, "--max-duration", "40ba", "--save-folder", str(folder), "--remote", remote,
                   env=env).returncode == 0
    state = folder / "step-000000000040" / "state.pt"
    with open(state, "r+b") as f:  # zeros where a lost page would be
        f.seek(state.stat().st_size // 2)
        f.write(bytes(4096))
    done = run_job("train", *ARGS, "--max-duration", "50ba", "--save-folder", str(folder), "--remote", remote, env=env)
    assert done.returncode == 0, done.stderr
    resumed = [e for e in events(done.stderr) if e.get("event") == "resumed"]
    assert [(e["step"], e["source"]) for e in resumed] == [(40, f"{remote}/step-000000000040")]
    assert "skipping corrupt checkpoint" in done.stderr


def test_sidecar_mode_writes_locally_and_uploader_watch_uploads(spawn, tmp_path, s3_bucket, uninterrupted):
    env, remote = s3_job_env(s3_bucket), s3_bucket.url("run")
    folder = tmp_path / "ck"
    folder.mkdir()
    watch = spawn(argv=[sys.executable, "-m", "uploader", "watch", str(folder), remote, "--poll-interval", "0.2"],
                  env=env)
    done = run_job("train", *ARGS, "--save-folder", str(folder), "--remote", remote, "--upload", "sidecar", env=env)
    assert done.returncode == 0, done.stderr
    assert watch.wait(timeout=60) == 0, watch.stderr  # exits by itself once the final checkpoint is up
    assert max(remote_steps(s3_bucket)) == 120
    shutil.rmtree(folder)
    info = json.loads(run_job("inspect", remote, env=env).stdout)
    assert info["model_sha256"] == uninterrupted["model_sha256"]


def test_a_disk_too_full_for_the_start_up_pull_exits_7_with_one_line(tmp_path, s3_bucket):
    """A spot node that came back with a smaller disk: say so, before training, and keep the bucket's
    checkpoint as it is (not set aside, not replaced by an older one)."""
    env, remote = s3_job_env(s3_bucket), s3_bucket.url("full")
    assert run_job("train", *ARGS, "--max-duration", "20ba", "--save-folder", str(tmp_path / "a"), "--remote", remote,
                   env=env).returncode == 0
    kept, folder = remote_steps(s3_bucket, "full"), tmp_path / "b"
    done = run_job("train", *ARGS, "--max-duration", "40ba", "--save-folder", str(folder), "--remote", remote, env=env,
                   preexec_fn=limit_file_size(16 * 1024))
    assert done.returncode == 7, done.stderr
    uploaded = local.list_committed(tmp_path / "a")[-1]  # what the bucket holds as its newest
    assert done.stderr.strip().splitlines()[-1] == "job: error: " + pull_refused(
        uploaded.name, uploaded.manifest().total_size, folder, FILE_TOO_LARGE)
    assert "Traceback" not in done.stderr
    assert not {"progress", "checkpoint"} & {e.get("event") for e in events(done.stderr)}  # before any training
    assert remote_steps(s3_bucket, "full") == kept
    assert not list(folder.glob("step-*")) and not list(folder.glob(".staging*"))


@pytest.mark.parametrize(
    "case, code, needle",
    [("wrong-secret", 3, "credentials"), ("read-only", 3, ""), ("missing-bucket", 4, "bucket"),
     ("invalid-bucket-name", 2, "invalidbucketname")],  # a bad flag: it was exit 1 with no advice (review)
)
def test_storage_errors_fail_fast_with_one_line(tmp_path, s3_bucket, case, code, needle):
    credentials = {"wrong-secret": Credentials(s3_bucket.credentials.access_key, "not-the-secret"),
                   "read-only": READER}.get(case)
    env = s3_job_env(s3_bucket, credentials)
    bucket_name = {"missing-bucket": "no-such-bucket-here", "invalid-bucket-name": "UPPER-case"}.get(
        case, s3_bucket.name)
    remote = f"s3://{bucket_name}/run"
    # read-only can list and read, so the start-up pull passes: the write check must catch it
    done = run_job("train", *ARGS, "--save-folder", str(tmp_path / "ck"), "--remote", remote, env=env)
    assert done.returncode == code, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("job: error:") and bucket_name in last and s3_bucket.endpoint_url in last
    assert needle in last.lower()
    assert "not-the-secret" not in done.stderr and s3_bucket.credentials.secret_key not in done.stderr
    assert "retry 1 of at most" not in done.stderr  # failed at once, not after a retry budget (uploader.retry)
    assert not {"start", "progress", "checkpoint"} & {e.get("event") for e in events(done.stderr)}  # before any training
    assert not list((tmp_path / "ck").glob("step-*"))


@pytest.mark.parametrize("upload", ["off", "inprocess"])
def test_a_file_remote_on_a_volume_not_mounted_stops_before_training(tmp_path, upload):
    """Read-only (--upload off), a missing volume was listed as an empty one: the run started again from step 0."""
    done = run_job("train", *ARGS, "--save-folder", str(tmp_path / "ck"), "--upload", upload,
                   "--remote", f"file://{tmp_path / 'not-mounted' / 'run'}")
    assert done.returncode == 4, done.stderr
    last = done.stderr.strip().splitlines()[-1]  # inprocess: its write check at start-up says it first
    assert last.startswith("job: error: ") and last.endswith(
        f"{tmp_path / 'not-mounted'} does not exist: mount the shared volume or fix the file:// URL")
    assert not {"start", "progress", "checkpoint"} & {e.get("event") for e in events(done.stderr)}
    assert not (tmp_path / "not-mounted").exists()


def test_read_only_credentials_may_resume_from_the_bucket_with_upload_off(tmp_path, s3_bucket, uninterrupted):
    """Pull-only is a legitimate use of read-only credentials: the write check is for jobs that upload."""
    remote = s3_bucket.url("run")
    first = run_job("train", *ARGS, "--save-folder", str(tmp_path / "a"), "--remote", remote, env=s3_job_env(s3_bucket))
    assert first.returncode == 0, first.stderr
    uploaded = remote_steps(s3_bucket)
    done = run_job("train", *ARGS, "--save-folder", str(tmp_path / "b"), "--remote", remote, "--upload", "off",
                   env=s3_job_env(s3_bucket, READER))
    assert done.returncode == 0, done.stderr
    resumed = [e for e in events(done.stderr) if e.get("event") == "resumed"]
    assert [(e["step"], e["source"]) for e in resumed] == [(120, f"{remote}/step-000000000120")]
    assert inspect(tmp_path / "b")["model_sha256"] == uninterrupted["model_sha256"]
    assert remote_steps(s3_bucket) == uploaded


def test_sigterm_uploads_the_final_checkpoint_before_exit(spawn, tmp_path, s3_bucket):
    env, remote = s3_job_env(s3_bucket), s3_bucket.url("run")
    proc = spawn("train", *ARGS, "--max-duration", "5000ba", "--save-interval", "100000ba",
                 "--save-folder", str(tmp_path / "ck"), "--remote", remote, env=env)
    proc.wait_event("progress", lambda e: e["step"] >= 15)
    proc.signal(signal.SIGTERM)
    assert proc.wait() == 75, proc.stderr
    preempted = proc.wait_event("preempted")
    assert preempted["uploaded"] is True and preempted["checkpoint_step"] == preempted["step"]
    assert max(remote_steps(s3_bucket)) == preempted["step"]


def test_sigterm_while_a_seeded_start_lists_the_bucket_exits_75_at_once(spawn, tmp_path, s3_bucket, fault_proxy):
    """--resume PATH with a --remote first asks the bucket whether the run has checkpoints of its own (job.resume
    seeded_or_own). That listing was not abandoned on a stop: a held one outlived the grace period (review 49)."""
    env, seed = s3_job_env(s3_bucket), tmp_path / "seed"
    assert run_job("train", *ARGS, "--max-duration", "20ba", "--save-folder", str(seed), env=env).returncode == 0
    fault_proxy.hold("list-type=2")
    proc = spawn("train", *ARGS, "--max-duration", "40ba", "--save-folder", str(tmp_path / "ck"), "--remote",
                 s3_bucket.url("run"), "--resume", str(seed / local.checkpoint_name(20)), "--grace-period", "30",
                 env={**env, "JOB_ENDPOINT_URL": fault_proxy.endpoint_url})
    wait_until(lambda: fault_proxy.counters.held > 0, timeout=120, what="the bucket's listing held")

    proc.signal(signal.SIGTERM)

    assert proc.wait(60) == 75, proc.stderr
    assert proc.wait_event("preempted")["step"] is None
    assert not any(e.get("event") in ("resumed", "start") for e in proc.events)


@pytest.mark.parametrize("second_pull", [False, True], ids=["start-up-pull", "pull-after-a-corrupt-local-one"])
def test_sigterm_during_the_start_up_download_exits_75_at_once(spawn, tmp_path, s3_bucket, fault_proxy, second_pull):
    """Nothing is trained before the first step, so a stop while the checkpoint to resume downloads has nothing
    to save. It was answered only once the download ended: a reclaimed spot node minutes into a large pull
    outlived its grace period and was killed; here, a held download ended after the retry budget (exit 5).
    ``second_pull``: the newest local checkpoint is corrupt and the start pulls it again from the bucket."""
    env, remote = s3_job_env(s3_bucket), s3_bucket.url("run")
    folder = tmp_path / "ck"
    assert run_job("train", *ARGS, "--max-duration", "20ba", "--save-folder", str(folder), "--remote", remote,
                   env=env).returncode == 0
    if second_pull:
        (folder / local.checkpoint_name(20) / "state.pt").write_bytes(b"damaged")
    else:
        shutil.rmtree(folder)  # a new machine
    fault_proxy.hold("/state.pt")
    proc = spawn("train", *ARGS, "--max-duration", "40ba", "--save-folder", str(folder), "--remote", remote,
                 "--grace-period", "30", env={**env, "JOB_ENDPOINT_URL": fault_proxy.endpoint_url})
    wait_until(lambda: fault_proxy.counters.held > 0, timeout=120, what="the download of state.pt held")

    proc.signal(signal.SIGTERM)

    assert proc.wait(300) == 75, proc.stderr
    preempted = proc.wait_event("preempted")
    assert preempted["step"] is None and preempted["reason"] == "SIGTERM"
    assert not any(e.get("event") in ("resumed", "start") for e in proc.events)  # not one step trained
    assert (folder / local.FINISHED_NAME).exists()  # a sidecar may leave
    assert remote_steps(s3_bucket) == [10, 20]  # the checkpoint being pulled is as it was, for the next start
    bucket = open_remote(remote, fast_config(s3_bucket.endpoint_url))
    try:
        assert list_set_aside(bucket) == []
    finally:
        bucket.close()


# `python -m job` that reports, as the last line of its stderr as it leaves (by sys.exit, or os._exit:
# job.cli.exit_now), which of the sharded path's heavy modules it imported.
REPORTS_IMPORTS = """
import atexit, os, sys
HEAVY = ("job.sharded", "job.dcp_storage", "torch.distributed.checkpoint", "torch.distributed.fsdp",
         "torch.distributed.tensor")
def report():
    print("imported:", *sorted(m for m in HEAVY if m in sys.modules), file=sys.stderr, flush=True)
def report_then_leave(code, leave=os._exit):
    report()
    leave(code)
atexit.register(report)
os._exit = report_then_leave
from job.entry import main
main()
"""


def test_an_unsharded_job_never_imports_dcp(tmp_path, s3_bucket):
    """torch.distributed.checkpoint, FSDP and DTensor take about 1.3 s to import (job.sharded_layout). An unsharded
    run's first start, its checkpoints and uploads, and a resume from the bucket onto an empty disk (the model
    built without its random initialisation) never import DCP; `job inspect`, which builds no optimizer (its
    constructor imports torch._dynamo, and that FSDP and DTensor), imports none of them."""
    env, remote = s3_job_env(s3_bucket), s3_bucket.url("light")

    def imported(*args: str) -> tuple[set[str], subprocess.CompletedProcess]:
        done = subprocess.run([sys.executable, "-c", REPORTS_IMPORTS, *args], env=env, capture_output=True, text=True,
                              timeout=120, cwd=REPO)
        assert done.returncode == 0, done.stderr[-3000:]
        report = done.stderr.splitlines()[-1]
        assert report.startswith("imported:"), done.stderr[-2000:]
        return set(report.split()[1:]), done

    dcp = {"job.sharded", "job.dcp_storage", "torch.distributed.checkpoint"}
    first, _ = imported("train", *ARGS, "--max-duration", "20ba", "--save-folder", str(tmp_path / "a"),
                        "--remote", remote)
    assert not first & dcp, first
    again, done = imported("train", *ARGS, "--max-duration", "30ba", "--save-folder", str(tmp_path / "b"),
                           "--remote", remote)
    assert not again & dcp, again
    assert [e["source"] for e in events(done.stderr) if e.get("event") == "resumed"] == [f"{remote}/step-000000000020"]
    for where in (remote, str(tmp_path / "b")):
        none, done = imported("inspect", where)
        assert not none, (where, none)
        assert json.loads(done.stdout)["step"] == 30
