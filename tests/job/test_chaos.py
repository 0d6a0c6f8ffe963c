"""Chaos: one training run, interrupted again and again on a new machine each time, ends exactly right.

SIGTERM and SIGKILL are mixed, at random moments and right after a checkpoint (while it uploads); the
local folder is deleted before every restart, so each life resumes from the bucket alone.
"""
from __future__ import annotations

import os
import random
import shutil
import signal

import pytest

from tests.support.jobs import inspect, run_job, s3_job_env

pytestmark = [pytest.mark.s3, pytest.mark.slow]

SAVE_EVERY = 10
ARGS = ["--model", "tests.support.slow_model:build", "--max-duration", "260ba", "--eval-interval", "50ba",
        "--save-interval", f"{SAVE_EVERY}ba", "--log-interval", "1", "--seed", "21", "--log-format", "json"]
# (signal, when): "random" waits a random time into the life, "after-save" strikes as a checkpoint uploads.
PLAN = [(signal.SIGTERM, "random"), (signal.SIGKILL, "after-save"), (signal.SIGKILL, "random"),
        (signal.SIGTERM, "after-save"), (signal.SIGKILL, "random"), (signal.SIGTERM, "random")]


def test_interrupted_six_times_on_new_machines_ends_bit_identical(spawn, tmp_path, s3_bucket):
    straight = tmp_path / "straight"
    assert run_job("train", *ARGS, "--save-folder", str(straight)).returncode == 0
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1 << 30)))
    rng = random.Random(seed)
    env, remote, folder = s3_job_env(s3_bucket), s3_bucket.url("chaos"), tmp_path / "ck"
    lives = []
    for sig, when in PLAN:
        proc = spawn("train", *ARGS, "--save-folder", str(folder), "--remote", remote, env=env)
        start = proc.wait_event("start")["step"]
        if when == "after-save":
            proc.wait_event("checkpoint", lambda e, s=start: e["step"] > s)
        else:
            proc.wait_event("progress", lambda e, s=start, n=rng.randrange(3, 40): e["step"] >= s + n)
        proc.signal(sig)
        code = proc.wait()
        reached = max(e["step"] for e in proc.events if e.get("event") == "progress")
        lives.append({"signal": signal.Signals(sig).name, "when": when, "start": start, "reached": reached,
                      "exit": code})
        shutil.rmtree(folder, ignore_errors=True)  # the machine is gone
    done = run_job("train", *ARGS, "--save-folder", str(folder), "--remote", remote, env=env)
    assert done.returncode == 0, done.stderr
    restart_steps = [life["start"] for life in lives[1:]] + [_resumed_step(done.stderr)]

    print(f"\nchaos seed {seed}: batches lost per interruption")
    for life, next_start in zip(lives, restart_steps):
        life["lost"] = life["reached"] - next_start
        print("  {signal:7} {when:10} steps {start:>3}..{reached:<3} exit {exit:>3}  lost {lost}".format(**life))
    assert inspect(folder)["model_sha256"] == inspect(straight)["model_sha256"], f"seed {seed}"
    for life in lives:
        if life["signal"] == "SIGTERM":
            assert life["exit"] == 75 and life["lost"] == 0, (seed, life)
        else:
            # Everything up to the newest checkpoint that reached the bucket survives: at most one save
            # interval, plus the steps trained while that checkpoint was still uploading.
            assert life["exit"] == -signal.SIGKILL and 0 <= life["lost"] <= SAVE_EVERY + 5, (seed, life)


def _resumed_step(stderr: str) -> int:
    import json

    for line in stderr.splitlines():
        if '"event": "resumed"' in line:
            return int(json.loads(line)["step"])
    raise AssertionError("the last life did not resume")
