"""`job train` under torchrun: two CPU processes (gloo), killed and restarted like one."""
from __future__ import annotations

import json
import os
import re
import signal
import sys

import pytest

from tests.support.checkpoints import corrupt_file
from tests.support.disk import limit_file_size
from tests.support.jobs import JobProcess, events, inspect, job_env, s3_job_env
from tests.support.polling import wait_until
from tests.support.procs import worker_of_rank
from uploader.local import list_committed
from uploader.runlog import LEDGER_DIR

pytestmark = pytest.mark.slow

ARGS = ["--model", "tests.support.slow_model:build", "--max-duration", "90ba", "--eval-interval", "30ba",
        "--save-interval", "10ba", "--log-interval", "2", "--seed", "13", "--log-format", "json"]


TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
JOB_LAUNCH = [sys.executable, "-m", "job", "launch"]  # torchrun that exits with its workers' code


def torchrun(*extra: str, launcher: list[str] = TORCHRUN) -> list[str]:
    # --standalone: a c10d rendezvous on localhost with a free port (loopback only).
    return [*launcher, "--standalone", "--nproc-per-node", "2", *extra, "-m", "job", "train", *ARGS]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    # A JobProcess, not subprocess.run: a run that hangs prints every rank's stacks into the error,
    # and its workers (in sessions of their own) are killed with the launcher instead of outliving it.
    folder = tmp_path_factory.mktemp("straight2")
    proc = JobProcess(torchrun() + ["--save-folder", str(folder)], env=job_env())
    code = proc.wait(300)
    assert code == 0, proc.stderr[-3000:]
    return inspect(folder)


def test_two_ranks_sigkilled_and_restarted_end_bit_identical(spawn, tmp_path, uninterrupted):
    folder = tmp_path / "ck"
    proc = spawn(argv=torchrun() + ["--save-folder", str(folder)], env=job_env())
    proc.wait_event("checkpoint", lambda e: e["step"] >= 30)
    proc.kill()  # the node is gone: launcher and both workers (JobProcess.kill takes the whole tree)
    restarted = spawn(argv=torchrun() + ["--save-folder", str(folder)], env=job_env())
    assert restarted.wait(timeout=300) == 0, restarted.stderr[-3000:]
    assert restarted.wait_event("resumed")["step"] >= 30
    info = inspect(folder)
    assert info["meta"]["world_size"] == 2
    assert info["model_sha256"] == uninterrupted["model_sha256"]


def test_three_ddp_ranks_sigkilled_and_restarted_end_bit_identical(spawn, tmp_path):
    """DDP all-reduced a life's first step in its first bucket layout and every later step in buckets regrouped
    by that step's backward; a ring all-reduce over 3 ranks rounds by where a value sits in its bucket, so a
    resumed run ended about 1e-8 off the uninterrupted one. Each life now settles the layout before its first
    step (job.ddp_buckets): parameters and train metrics bit for bit, as on 1 and 2 ranks. The model has
    dropout (the warm-up draws nothing that stays drawn) and a head used in training only (a warm-up in eval
    mode left it without a gradient, and DDP failed the first step: review 51)."""
    def three_ranks(folder: str) -> list[str]:
        return [*TORCHRUN, "--standalone", "--nproc-per-node", "3", "-m", "job", "train", *ARGS, "--batch-size", "48",
                "--model", "tests.support.slow_model:with_training_head", "--max-duration", "40ba",
                "--save-folder", str(tmp_path / folder)]

    straight = spawn(argv=three_ranks("straight"), env=job_env())
    assert straight.wait(timeout=300) == 0, straight.stderr[-3000:]
    killed = spawn(argv=three_ranks("ck"), env=job_env())
    killed.wait_event("checkpoint", lambda e: e["step"] >= 10)
    killed.kill()
    restarted = spawn(argv=three_ranks("ck"), env=job_env())
    assert restarted.wait(timeout=300) == 0, restarted.stderr[-3000:]
    assert 10 <= restarted.wait_event("resumed")["step"] < 40
    assert inspect(tmp_path / "ck")["model_sha256"] == inspect(tmp_path / "straight")["model_sha256"]
    assert restarted.wait_event("finished")["metrics"] == straight.wait_event("finished")["metrics"]


def test_sigterm_stops_both_ranks_at_the_same_step_with_a_final_checkpoint(spawn, tmp_path, uninterrupted):
    folder = tmp_path / "ck"
    proc = spawn(argv=torchrun() + ["--save-folder", str(folder)], env=job_env())
    proc.wait_event("progress", lambda e: e["step"] >= 15)
    proc.signal(signal.SIGTERM)  # torchrun forwards it to every worker
    proc.wait(timeout=120)
    preempted = proc.wait_event("preempted")
    assert preempted["checkpoint_step"] == preempted["step"]
    assert inspect(folder)["step"] == preempted["step"]
    restarted = spawn(argv=torchrun() + ["--save-folder", str(folder)], env=job_env())
    assert restarted.wait(timeout=300) == 0, restarted.stderr[-3000:]
    assert inspect(folder)["model_sha256"] == uninterrupted["model_sha256"]
    # Rank 0 alone keeps the ledger: one record per life, not one per rank.
    lives = sorted((json.loads(p.read_text()) for p in (folder / LEDGER_DIR).glob("*.json")), key=lambda r: r["started"])
    assert [(r["world_size"], r["end"]["how"]) for r in lives] == [(2, "preempted"), (2, "finished")]
    assert lives[1]["start"]["from_step"] == preempted["step"]


def test_elastic_restart_after_one_rank_is_killed_completes(spawn, tmp_path, uninterrupted):
    folder = tmp_path / "ck"
    # One restart must be enough (job.distributed gives each restarted group its own store namespace).
    proc = spawn(argv=torchrun("--max-restarts", "1") + ["--save-folder", str(folder)], env=job_env())
    proc.wait_event("checkpoint", lambda e: e["step"] >= 20)
    wait_until(lambda: worker_of_rank(proc.proc.pid, 1) is not None, what="rank 1's process")
    os.kill(worker_of_rank(proc.proc.pid, 1), signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, proc.stderr[-3000:]
    resumed = [e for e in proc.events if e.get("event") == "resumed"]
    assert resumed and resumed[-1]["step"] >= 20  # the restarted group went on from a checkpoint
    assert inspect(folder)["model_sha256"] == uninterrupted["model_sha256"]


@pytest.mark.s3
def test_sharded_checkpoints_round_trip_through_the_bucket(spawn, tmp_path, s3_bucket):
    """FSDP2: each rank writes its shards (DCP); the manifest lists every file; a new machine resumes from the bucket."""
    from tests.job.test_remote import remote_steps

    sharded = ["--sharded"]
    straight = tmp_path / "straight"
    done = spawn(argv=torchrun() + sharded + ["--save-folder", str(straight)], env=job_env())
    assert done.wait(timeout=300) == 0, done.stderr[-3000:]
    expected = inspect(straight)

    env, remote, folder = s3_job_env(s3_bucket), s3_bucket.url("sharded"), tmp_path / "ck"
    proc = spawn(argv=torchrun() + sharded + ["--save-folder", str(folder), "--remote", remote], env=env)
    wait_until(lambda: any(s >= 30 for s in remote_steps(s3_bucket, "sharded")), timeout=180,
               what="a sharded checkpoint in the bucket")
    proc.kill()
    import shutil

    shutil.rmtree(folder)
    restarted = spawn(argv=torchrun() + sharded + ["--save-folder", str(folder), "--remote", remote], env=env)
    assert restarted.wait(timeout=300) == 0, restarted.stderr[-3000:]
    assert restarted.wait_event("resumed")["source"].startswith(remote)
    newest = sorted(p for p in folder.iterdir() if p.name.startswith("step-"))[-1]
    names = sorted(p.name for p in newest.iterdir())
    # Each rank's shards in __R_0, the replicated tensors DCP gave it (step counts) in a small __R_1.
    assert set(names) - {"__0_1.distcp", "__1_1.distcp"} == {
        "__0_0.distcp", "__1_0.distcp", "dcp-metadata.json", "manifest.json", "rank-00000-of-00002.pt",
        "rank-00001-of-00002.pt", "replicated.pt"}
    info = inspect(folder)
    assert info["meta"]["sharded"] is True
    assert info["model_sha256"] == expected["model_sha256"]


@pytest.mark.parametrize("resume, refusal, code", [
    ("auto", "none of the 1 checkpoint(s) in {folder} verifies", 6),
    ("never", "--resume never: {folder} already holds checkpoints of a run", 2),
], ids=["nothing verifies", "a new run in a run's folder"])
def test_when_rank_0_refuses_to_start_every_rank_says_why_with_its_exit_code(tmp_path, resume, refusal, code):
    """Rank 0 alone decides where a run starts. Its refusal once reached rank 1 as a closed connection at
    the next collective: exit 1, 'a bug', with a traceback."""
    folder = tmp_path / "ck"
    first = JobProcess(torchrun() + ["--max-duration", "10ba", "--model", "mlp", "--save-folder", str(folder)],
                       env=job_env())
    assert first.wait(180) == 0, first.stderr[-3000:]
    if resume == "auto":
        corrupt_file(list_committed(folder)[-1].path / "state.pt")

    again = JobProcess(torchrun() + ["--model", "mlp", "--save-folder", str(folder), "--resume", resume],
                       env=job_env())
    again.wait(180)

    errors = sorted(line for line in again.stderr.splitlines() if line.startswith("job: error:"))
    said = refusal.format(folder=folder)
    assert len(errors) == 2 and said in errors[0] and said in errors[1], again.stderr[-3000:]
    assert "rank 0 could not " in errors[1] and f"(exitcode: {code})" in again.stderr
    assert "unexpected error" not in again.stderr and "Connection closed" not in again.stderr  # torchrun's own
    # traceback (ChildFailedError) follows, as for any failed worker


@pytest.mark.parametrize("save", ["--sync-save", "--async-save"])
def test_when_rank_0_cannot_write_a_checkpoint_every_rank_exits_7_and_says_why(tmp_path, save):
    """Rank 0 alone writes an unsharded checkpoint. Its full disk once reached rank 1 as a closed connection
    at the next collective: exit 1, 'a bug', with a traceback. The file size limit stands for the full disk
    (it is every rank's: only rank 0 writes a checkpoint)."""
    folder = tmp_path / "ck"
    done = JobProcess(torchrun() + [save, "--model", "mlp", "--max-duration", "30ba", "--save-folder", str(folder)],
                      env=job_env(), preexec_fn=limit_file_size(16 * 1024))
    done.wait(180)

    own, told = every_rank_failed(done.stderr, 7, "write its checkpoint")
    assert own.startswith("job: error: cannot write a checkpoint to") and "previous checkpoint is untouched" in own
    assert "(CheckpointWriteError: cannot write a checkpoint to" in told and list_committed(folder) == []


@pytest.mark.parametrize("save", ["--async-save", "--sync-save", "--sharded"])
def test_when_training_diverges_no_rank_writes_its_checkpoint_and_every_rank_exits_8(tmp_path, save):
    """Unsharded, rank 0 finds the NaN in the state it writes and tells the others; sharded, each rank looks at
    its own shards and every rank hears of any rank's at the gather (test_cli has the run on one process)."""
    folder = tmp_path / "ck"
    args = [save, "--model", "mlp", "--max-duration", "30ba", "--keep", "2", "--save-folder", str(folder)]
    good = JobProcess(torchrun() + args, env=job_env())
    assert good.wait(180) == 0, good.stderr[-3000:]
    before = [(c.step, c.manifest()) for c in list_committed(folder)]
    diverged = JobProcess(torchrun() + args + ["--max-duration", "90ba", "--lr", "1e30"], env=job_env())
    diverged.wait(180)

    if save == "--sharded":  # every rank says what the rank that found it said
        errors = [line for line in diverged.stderr.splitlines() if line.startswith("job: error:")]
        assert len(set(errors)) == 1 and len(errors) == 2, diverged.stderr[-3000:]
        assert re.findall(r"exitcode\s*: (\d+) \(pid", diverged.stderr) == ["8"] * 2
        own = errors[0].replace("job: error: rank 0: ", "job: error: ").replace("job: error: rank 1: ", "job: error: ")
    else:
        own, told = every_rank_failed(diverged.stderr, 8, "write its checkpoint")
        assert "(Diverged: training diverged at step " in told
    # A parameter named: found among the state dict's entries (DCP's shards, sharded) by its storage
    assert own.startswith("job: error: training diverged at step ") and ": model." in own, own
    assert f"(newest in {folder}: step 30)" in own, own
    assert [(c.step, c.manifest()) for c in list_committed(folder)] == before


@pytest.mark.s3
@pytest.mark.parametrize(("fault", "when", "code", "what"), [
    ("denied", "mid-run", 3, "upload its checkpoints"),  # the credentials lost the right to write there
    ("held", "at the end", 5, "upload the final checkpoint"),  # past --final-upload-timeout
    ("denied", "preempted", 3, "upload its checkpoints"),  # the preemption's upload: the only one of the run
])
def test_when_rank_0_cannot_upload_every_rank_exits_with_its_code(fault_proxy, s3_bucket, tmp_path, fault, when,
                                                                   code, what):
    """Rank 0 alone uploads an unsharded run's checkpoints; its failure once reached rank 1 as a closed
    connection (exit 1), or, past the final upload's wait, as a timed-out barrier."""
    env = {**s3_job_env(s3_bucket), "JOB_ENDPOINT_URL": fault_proxy.endpoint_url}
    (fault_proxy.deny if fault == "denied" else fault_proxy.hold)(f"/{s3_bucket.name}/run/step-")
    argv = torchrun() + ["--model", "mlp", "--max-duration", "30ba", "--save-folder", str(tmp_path / "ck"),
                         "--remote", s3_bucket.url("run"), "--final-upload-timeout", "2"]
    if when == "preempted":  # no checkpoint before the one the stop takes; SIGTERM to rank 1 after the last step
        argv[argv.index("job")] = "tests.support.late_signal_job"
        argv += ["--save-interval", "1000ba"]
    done = JobProcess(argv, env=env)
    done.wait(180)

    own, told = every_rank_failed(done.stderr, code, what)
    assert s3_bucket.name in own and own.removeprefix("job: error: ") in told


def every_rank_failed(stderr: str, code: int, what: str) -> tuple[str, str]:
    """Both ranks exited ``code``, rank 0 with its own error line, rank 1 naming it as what rank 0 could not
    do; the two lines."""
    errors = [line for line in stderr.splitlines() if line.startswith("job: error:")]
    told = [line for line in errors if f"job: error: rank 0 could not {what} (" in line]
    assert len(errors) == 2 and len(told) == 1, stderr[-3000:]
    assert re.findall(r"exitcode\s*: (\d+) \(pid", stderr) == [str(code)] * 2  # torchrun's summary of both
    assert "Connection closed" not in stderr
    return next(line for line in errors if line not in told), told[0]


@pytest.mark.parametrize("late", [False, True], ids=["mid-run", "after-the-last-step"])
def test_a_signal_that_reaches_one_rank_is_what_every_rank_stops_for(spawn, tmp_path, late):
    """A spot reclaim signals one node's processes only. The others stopped for "another rank is stopping",
    and rank 0's ledger, hearing of no stop, counted the final save as productive time (final_save_s null).
    Rank 0 alone logs at info (its events are the run's). After the last step's agree, each rank once went
    its own way (rank 1 to the preemption's collectives, rank 0 to the end's): a hang, or both exit 1."""
    folder = tmp_path / "ck"
    if late:
        argv = torchrun() + ["--save-folder", str(folder)]
        argv[argv.index("job")] = "tests.support.late_signal_job"  # SIGTERM to rank 1 as its loop returns
        proc = spawn(argv=argv, env=job_env())
    else:
        proc = spawn(argv=torchrun() + ["--save-folder", str(folder)], env=job_env())
        proc.wait_event("progress", lambda e: e["step"] >= 15)
        wait_until(lambda: worker_of_rank(proc.proc.pid, 1) is not None, what="rank 1's process")
        os.kill(worker_of_rank(proc.proc.pid, 1), signal.SIGTERM)  # rank 1 alone
    proc.wait(timeout=120)
    assert "(exitcode: 75)" in proc.stderr, proc.stderr[-3000:]  # torchrun's own is 1
    stops = [(e["event"], e["reason"]) for e in events(proc.stderr)
             if e.get("event") in ("stop_requested", "preempted")]
    assert stops == [("stop_requested", "SIGTERM (on another rank)"), ("preempted", "SIGTERM (on another rank)")]
    (life,) = [json.loads(p.read_text()) for p in (folder / LEDGER_DIR).glob("*.json")]
    assert life["end"]["reason"] == "SIGTERM (on another rank)" and life["end"]["final_save_s"] is not None


@pytest.mark.parametrize("stop", ["bad flags", "one worker signalled", "launcher signalled"])
def test_job_launch_exits_with_its_workers_code_where_torchrun_exits_1(spawn, tmp_path, stop):
    """Kubernetes reads the container's exit code, and a multi-node pod's container is the launcher:
    torchrun's 1 matched neither the free restart of a preemption (75: a spot notice stops the workers
    before any SIGTERM reaches the pod) nor the failure of a misconfigured run (2, 3, 4, 6)."""
    flags = ["--max-duration", "0ba"] if stop == "bad flags" else []
    proc = spawn(argv=torchrun("--max-restarts", "0", launcher=JOB_LAUNCH) + ["--save-folder", str(tmp_path / "ck"),
                                                                              *flags], env=job_env())
    if stop != "bad flags":
        proc.wait_event("progress", lambda e: e["step"] >= 15)
    if stop == "one worker signalled":  # as a spot notice does: the workers stop, the launcher is not signalled
        wait_until(lambda: worker_of_rank(proc.proc.pid, 1) is not None, what="rank 1's process")
        os.kill(worker_of_rank(proc.proc.pid, 1), signal.SIGTERM)
    elif stop == "launcher signalled":
        proc.signal(signal.SIGTERM)
    code = proc.wait(timeout=120)
    assert code == (2 if stop == "bad flags" else 75), proc.stderr[-3000:]
    assert f"; exiting {code}" in proc.stderr.splitlines()[-1]
    if stop != "bad flags":
        assert proc.wait_event("preempted")["checkpoint_step"] >= 15
