"""A pod's life as Kubernetes runs it, with real processes: the job and its native-sidecar uploader share
an emptyDir; preemption sends SIGTERM to the job first and to the sidecar after the job exits; the next pod
starts on another node with an empty folder and must end with the uninterrupted model, bit for bit.
"""
from __future__ import annotations

import signal
import sys

import pytest

from tests.support.jobs import inspect, run_job, s3_job_env

pytestmark = [pytest.mark.s3, pytest.mark.slow]

# Configured the way k8s/base configures the containers: environment variables only.
JOB_ENV = {"JOB_MODEL": "tests.support.slow_model:build", "JOB_MAX_DURATION": "150ba", "JOB_SEED": "4",
           "JOB_SAVE_INTERVAL": "25ba", "JOB_EVAL_INTERVAL": "50ba", "JOB_LOG_FORMAT": "json",
           "JOB_LOG_INTERVAL": "5", "JOB_UPLOAD": "sidecar", "JOB_GRACE_PERIOD": "20"}
SIDECAR_ENV = {"UPLOADER_POLL_INTERVAL": "0.2", "UPLOADER_GRACE": "30"}


def start_pod(spawn, tmp_path, name, bucket):
    """One pod: a fresh emptyDir, the sidecar started first (an initContainer), then the job."""
    folder = tmp_path / name / "checkpoints"
    folder.mkdir(parents=True)
    remote = bucket.url("run")
    env = s3_job_env(bucket, JOB_SAVE_FOLDER=str(folder), JOB_REMOTE=remote, **JOB_ENV, **SIDECAR_ENV)
    sidecar = spawn(argv=[sys.executable, "-m", "uploader", "watch", str(folder), remote], env=env)
    job = spawn("train", env=env)
    return folder, job, sidecar


def test_preempted_pod_then_new_pod_on_another_node_ends_bit_identical(spawn, tmp_path, s3_bucket):
    straight = tmp_path / "straight"
    assert run_job("train", "--save-folder", str(straight),
                   env=s3_job_env(s3_bucket, **{**JOB_ENV, "JOB_UPLOAD": "off"})).returncode == 0

    _, job, sidecar = start_pod(spawn, tmp_path, "pod-1", s3_bucket)
    job.wait_event("checkpoint", lambda e: e["step"] >= 25)
    job.wait_event("progress", lambda e: e["step"] >= 40)
    job.signal(signal.SIGTERM)  # node drain / spot reclaim: main containers first
    assert job.wait() == 75, job.stderr
    sidecar.signal(signal.SIGTERM)  # native sidecars after the main containers have exited
    assert sidecar.wait(timeout=60) == 0, sidecar.stderr
    stopped_at = job.wait_event("preempted")["step"]

    folder, job, sidecar = start_pod(spawn, tmp_path, "pod-2", s3_bucket)  # another node: empty emptyDir
    assert job.wait(timeout=120) == 0, job.stderr
    resumed = job.wait_event("resumed")
    assert resumed["step"] == stopped_at and resumed["source"].startswith(s3_bucket.url("run"))
    assert sidecar.wait(timeout=60) == 0, sidecar.stderr  # exits by itself once the last checkpoint is up
    assert inspect(folder)["model_sha256"] == inspect(straight)["model_sha256"]
    bucket_info = inspect_remote(s3_bucket)
    assert (bucket_info["step"], bucket_info["model_sha256"]) == (150, inspect(straight)["model_sha256"])


def inspect_remote(bucket):
    import json

    done = run_job("inspect", bucket.url("run"), env=s3_job_env(bucket))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
