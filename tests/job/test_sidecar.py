"""The job and `uploader watch` as two real processes sharing a folder, stopped in both orders."""
from __future__ import annotations

import json
import signal
import sys

import pytest

from tests.job.test_remote import remote_steps
from tests.support.jobs import run_job, s3_job_env

pytestmark = [pytest.mark.s3, pytest.mark.slow]

ARGS = ["--max-duration", "100000ba", "--save-interval", "100000ba", "--eval-interval", "100000ba",
        "--log-interval", "5", "--log-format", "json", "--upload", "sidecar", "--grace-period", "20",
        "--model", "tests.support.slow_model:build"]


@pytest.mark.parametrize("order", ["kubernetes-native-sidecar", "both-at-once"])
def test_final_checkpoint_reaches_the_bucket_whatever_the_signal_order(spawn, tmp_path, s3_bucket, order):
    env, remote = s3_job_env(s3_bucket), s3_bucket.url("run")
    folder = tmp_path / "shared"
    folder.mkdir()
    watch = spawn(argv=[sys.executable, "-m", "uploader", "watch", str(folder), remote, "--poll-interval", "0.2",
                        "--grace", "30"], env=env)
    job = spawn("train", *ARGS, "--save-folder", str(folder), "--remote", remote, env=env)
    job.wait_event("progress", lambda e: e["step"] >= 10)
    if order == "kubernetes-native-sidecar":  # the job first; the sidecar only after the job has exited
        job.signal(signal.SIGTERM)
        assert job.wait() == 75
        watch.signal(signal.SIGTERM)
    else:  # docker compose, clusters without native sidecars
        job.signal(signal.SIGTERM)
        watch.signal(signal.SIGTERM)
        assert job.wait() == 75
    assert watch.wait(timeout=60) == 0, watch.stderr
    preempted = job.wait_event("preempted")
    assert preempted["checkpoint_step"] == preempted["step"]
    assert max(remote_steps(s3_bucket)) == preempted["step"]
    # The sidecar uploads the run log too: the job's life, ended by the preemption, is in the bucket.
    done = run_job("report", remote, "--format", "json", env=env)
    assert done.returncode == 0, done.stderr
    (life,) = json.loads(done.stdout)["lives"]
    assert (life["end"], life["last_step"]) == ("preempted", preempted["step"])
