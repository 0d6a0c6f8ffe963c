"""SIGTERM / SIGINT and spot notices: a preemption costs zero batches and changes nothing."""
from __future__ import annotations

import re
import signal
import socket
import sys

import pytest

from tests.support.jobs import REPO, inspect, job_env, run_job
from tests.support.metadata import MetadataServer
from tests.support.polling import wait_until
from uploader import local

pytestmark = pytest.mark.slow

# Long enough that the signal always lands mid-run; few evals so steps stay fast.
ARGS = ["--max-duration", "3000ba", "--eval-interval", "1000ba", "--log-interval", "5", "--seed", "5",
        "--log-format", "json"]


def _started(proc, step: int = 10) -> dict:
    return proc.wait_event("progress", lambda e: e["step"] >= step)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_checkpoints_the_current_step_and_exits_75(spawn, tmp_path, sig):
    folder = tmp_path / "ck"
    proc = spawn("train", *ARGS, "--save-folder", str(folder), "--save-interval", "100000ba")
    _started(proc)
    proc.signal(sig)
    assert proc.wait() == 75, proc.stderr
    preempted = proc.wait_event("preempted")
    assert preempted["checkpoint_step"] == preempted["step"] > 0  # zero batches lost
    assert preempted["uploaded"] is None  # no --remote: nothing was uploaded, and the event does not claim it
    assert inspect(folder)["step"] == preempted["step"]
    assert local.read_finished(folder) == preempted["step"]


@pytest.mark.parametrize("who", ["worker", "launcher"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_before_training_can_answer_it_is_exit_75_at_once(spawn, tmp_path, sig, who):
    """Rank 0 of two under torchrun's environment waits in the rendezvous for a rank that never comes, in C++,
    where no Python signal handler runs: the SIGTERM of a reclaimed node killed it with 143 (a failure to
    podFailurePolicy, not a preemption), and SIGINT ended in a traceback. So did `job launch` on the first of
    two nodes, waiting in torchrun's rendezvous for the second. Nothing is trained, nothing saved."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tmp_path / "ck"
    if who == "worker":
        proc = spawn("train", *ARGS, "--save-folder", str(folder), env=job_env(
            WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    else:
        proc = spawn("launch", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                     "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "one-of-two", "-m", "job", "train", *ARGS,
                     "--save-folder", str(folder), env=job_env())
    wait_until(lambda: _listening(port), timeout=60, what=f"the {who} waiting in the rendezvous")

    proc.signal(sig)

    assert proc.wait(30) == 75, proc.stderr
    assert proc.stderr.splitlines()[-1] == (f"job: stopped by {sig.name} before training started or after it ended: "
                                            "nothing to save; exiting 75 (the next start resumes from the newest "
                                            "checkpoint)")
    assert not folder.exists() or not any(folder.iterdir())


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_ctrl_c_to_the_whole_group_stops_once_with_dataloader_workers(spawn, tmp_path):
    """Ctrl-C reaches every process of the terminal's group, DataLoader workers included: the job
    stops once, and the workers leave it to the job instead of announcing a stop of their own."""
    folder = tmp_path / "ck"
    proc = spawn("train", *ARGS, "--num-workers", "2", "--save-folder", str(folder), "--save-interval", "100000ba",
                 new_session=True)
    _started(proc)
    proc.signal_group(signal.SIGINT)
    assert proc.wait() == 75, proc.stderr
    assert [e.get("event") for e in proc.events].count("stop_requested") == 1, proc.stderr
    preempted = proc.wait_event("preempted")
    assert inspect(folder)["step"] == preempted["checkpoint_step"] == preempted["step"]


def test_preempted_run_resumes_to_the_uninterrupted_result(spawn, tmp_path):
    short = ["--max-duration", "150ba", "--eval-interval", "50ba", "--log-interval", "5", "--seed", "5",
             "--log-format", "json"]
    straight = tmp_path / "straight"
    assert run_job("train", *short, "--save-folder", str(straight)).returncode == 0
    folder = tmp_path / "ck"
    proc = spawn("train", *short, "--save-folder", str(folder))
    _started(proc, 20)
    proc.signal(signal.SIGTERM)
    assert proc.wait() == 75, proc.stderr
    assert run_job("train", *short, "--save-folder", str(folder)).returncode == 0
    assert inspect(folder)["model_sha256"] == inspect(straight)["model_sha256"]


def test_second_signal_exits_at_once_and_keeps_the_previous_checkpoint(spawn, tmp_path):
    folder, marker = tmp_path / "ck", tmp_path / "saving"
    # The second periodic save pauses before its manifest is written; both signals land during it.
    proc = spawn(argv=[sys.executable, "-m", "tests.support.slow_save_job", str(marker), "2", "--",
                       "train", *ARGS, "--save-folder", str(folder), "--save-interval", "10ba"], cwd=REPO)
    proc.wait_event("checkpoint", lambda e: e["step"] == 10)
    import time

    while not marker.exists():
        time.sleep(0.05)
    proc.signal(signal.SIGTERM)
    proc.wait_event("stop_requested")
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 75
    assert proc.wait_event("killed")["signal"] == "SIGTERM"
    assert [c.step for c in local.list_committed(folder)] == [10]
    assert inspect(folder)["step"] == 10


def test_grace_too_short_says_so_and_exits_before_the_kill(spawn, tmp_path):
    folder = tmp_path / "ck"
    proc = spawn("train", *ARGS, "--save-folder", str(folder), "--save-interval", "10ba", "--grace-period", "0")
    proc.wait_event("checkpoint", lambda e: e["step"] >= 20)
    proc.signal(signal.SIGTERM)
    assert proc.wait() == 75, proc.stderr
    warning = proc.wait_event("grace_too_short")
    preempted = proc.wait_event("preempted")
    assert warning["kept_step"] == preempted["checkpoint_step"] < preempted["step"]
    assert preempted["checkpoint_step"] in [c.step for c in local.list_committed(folder)]
    # A periodic write left in flight at the stop may still land before the exit; the event names it.
    assert inspect(folder)["step"] in (preempted["checkpoint_step"], preempted["writing_step"])


def test_grace_too_short_mid_write_exits_75_with_the_previous_checkpoint(spawn, tmp_path):
    """The second checkpoint is inside torch.save when SIGTERM comes with no grace: the job must not wait
    for it, must not be aborted by the runtime for leaving it behind, and reports (and marks for the
    sidecar) the checkpoint that is really on disk."""
    folder, marker = tmp_path / "ck", tmp_path / "saving"
    proc = spawn(argv=[sys.executable, "-m", "tests.support.slow_save_job", str(marker), "2", "torch-save", "--",
                       "train", *ARGS, "--save-folder", str(folder), "--save-interval", "10ba",
                       "--grace-period", "0"], cwd=REPO)
    wait_until(marker.exists, what="the second checkpoint to be inside torch.save")
    proc.signal(signal.SIGTERM)
    assert proc.wait() == 75, proc.stderr
    assert "terminate called" not in proc.stderr
    assert proc.wait_event("grace_too_short")["kept_step"] == proc.wait_event("preempted")["checkpoint_step"] == 10
    assert [c.step for c in local.list_committed(folder)] == [10]
    assert local.read_finished(folder) == 10
    resumed = run_job("train", *ARGS, "--max-duration", "30ba", "--save-folder", str(folder))
    assert resumed.returncode == 0, resumed.stderr
    assert inspect(folder)["step"] == 30


def test_aws_notice_checkpoints_at_once_and_training_goes_on(spawn, tmp_path):
    folder = tmp_path / "ck"
    with MetadataServer() as imds:
        proc = spawn("train", *ARGS, "--save-folder", str(folder), "--save-interval", "100000ba",
                     "--spot-notice", "aws", "--spot-endpoint", imds.url, "--spot-poll-interval", "0.2")
        _started(proc)
        imds.notice_aws(seconds_from_now=120)
        notice = proc.wait_event("spot_notice")
        assert (notice["provider"], notice["kind"]) == ("aws", "terminate")
        assert notice["deadline"] == imds.aws_deadline() and 0 < notice["seconds_left"] <= 120
        saved = proc.wait_event("checkpoint")
        assert saved["step"] == notice["step"]
        proc.wait_event("progress", lambda e: e["step"] > saved["step"] + 10)  # keeps training
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 75
    assert imds.tokens_issued >= 1 and imds.rejected == 0  # IMDSv2: token first, every read carried it


@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_notice_with_a_near_deadline_stops_by_itself(spawn, tmp_path, provider):
    """No SIGTERM at all: the deadline (AWS time, GCP's 30 s) comes within the grace period."""
    folder = tmp_path / "ck"
    with MetadataServer() as meta:
        proc = spawn("train", *ARGS, "--save-folder", str(folder), "--save-interval", "100000ba",
                     "--spot-notice", provider, "--spot-endpoint", meta.url, "--spot-poll-interval", "0.2",
                     "--grace-period", "40")
        _started(proc)
        if provider == "aws":
            meta.notice_aws(seconds_from_now=20)
        else:
            meta.gce_preempted = True
        assert proc.wait(timeout=90) == 75, proc.stderr
    preempted = proc.wait_event("preempted")
    assert preempted["checkpoint_step"] == preempted["step"]
    assert "spot notice" in preempted["reason"]


def test_sigusr1_prints_every_threads_stack_and_training_goes_on(spawn, tmp_path):
    folder = tmp_path / "ck"
    proc = spawn("train", *ARGS, "--max-duration", "200ba", "--save-folder", str(folder), "--save-interval", "50ba")
    _started(proc)
    proc.dump_stacks()  # what the test harness does to a job that outlives its timeout
    assert proc.wait() == 0, proc.stderr
    assert "Current thread" in proc.stderr and 'File "' in proc.stderr
    assert re.search(r'File ".*job/loop\.py", line \d+ in ', proc.stderr), proc.stderr  # the training thread's
    assert inspect(folder)["step"] == 200
