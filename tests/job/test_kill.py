"""Real processes killed with SIGKILL: nothing half-written is ever used, and the result is unchanged."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.support.jobs import REPO, inspect, job_cmd, job_env, run_job
from uploader import local

ARGS = ["--max-duration", "96ba", "--eval-interval", "24ba", "--seed", "11", "--log-format", "json"]

pytestmark = pytest.mark.slow


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the job")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    assert run_job("train", *ARGS, "--save-folder", str(folder)).returncode == 0
    return inspect(folder)


def test_sigkill_during_save_leaves_previous_checkpoint_usable(tmp_path, uninterrupted):
    folder, marker = tmp_path / "ck", tmp_path / "saving"
    cmd = [sys.executable, "-m", "tests.support.slow_save_job", str(marker), "3", "--",
           "train", *ARGS, "--save-folder", str(folder), "--save-interval", "16ba", "--sync-save"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(marker.exists)  # the third save (step 48) has written its data, not yet its manifest
        proc.kill()
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert [c.step for c in local.list_committed(folder)] == [16, 32]
    assert inspect(folder)["step"] == 32
    resumed = run_job("train", *ARGS, "--save-folder", str(folder))
    assert resumed.returncode == 0, resumed.stderr
    assert inspect(folder)["model_sha256"] == uninterrupted["model_sha256"]


def test_sigkill_at_any_moment_then_restart_gives_the_same_model(tmp_path, uninterrupted):
    folder = tmp_path / "ck"
    for delay in (2.0, 0.7):
        proc = subprocess.Popen(job_cmd("train", *ARGS, "--save-folder", str(folder), "--save-interval", "5ba"),
                                cwd=REPO, env=job_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        proc.kill()
        proc.wait(timeout=30)
    done = run_job("train", *ARGS, "--save-folder", str(folder), "--save-interval", "5ba")
    assert done.returncode == 0, done.stderr
    assert inspect(folder)["model_sha256"] == uninterrupted["model_sha256"]
