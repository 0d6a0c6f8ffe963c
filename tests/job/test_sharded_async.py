"""Issue 18, point 4: sharded saves stop blocking training. Real torchrun processes on CPU (gloo).

A sharded (FSDP2) checkpoint is asynchronous like an unsharded one: the loop blocks for the copy of each
rank's shards into host buffers and DCP's planning; the write, digest and commit come later. Each
background write is held (or made to fail) by tests.support.gated_sharded_job, in the job's own
processes: the loop goes on while it is held, what is written is the state of the step it was taken
at, a failure is one CheckpointWriteError on every rank, and a SIGTERM during a held write still ends
on a committed checkpoint of the stop step that resumes bit for bit. Every comparison is with a run
whose every checkpoint is synchronous (``--sync-save``).
"""
from __future__ import annotations

import signal
from pathlib import Path

import pytest
import torch

from job.checkpoint import describe, load_state_file, open_checkpoint
from job.sharded import by_id
from tests.support.elastic import TORCHRUN
from tests.support.jobs import JobProcess, events, job_env
from tests.support.polling import wait_until
from uploader.local import STAGING_PREFIX, checkpoint_name, list_committed

pytestmark = pytest.mark.slow

ARGS = ["--sharded", "--model", "tests.support.slow_model:build", "--max-duration", "40ba", "--eval-interval",
        "1000ba", "--save-interval", "10ba", "--keep", "10", "--log-interval", "2", "--seed", "13", "--log-format",
        "json"]


def job(folder: Path, *extra: str, gate: Path | None = None, mode: str = "hold") -> JobProcess:
    """`job train` on 2 ranks; with ``gate``, its background sharded writes held or failing (``mode``)."""
    module = ["-m", "job"] if gate is None else ["-m", "tests.support.gated_sharded_job", str(gate), mode, "--"]
    return JobProcess([*TORCHRUN, "--nproc-per-node", "2", *module, "train", *ARGS, "--save-folder", str(folder),
                       *extra], env=job_env())


def model_sha256(folder: Path, step: int) -> str:
    return describe(*open_checkpoint(folder / checkpoint_name(step)))["model_sha256"]


def held(gate: Path, step: int) -> bool:
    return all((gate / f"held-{step}-rank{rank}").exists() for rank in range(2))


def held_at_10(tmp_path: Path, trained_to: int) -> tuple[JobProcess, Path, Path]:
    """A run whose write of step 10 is held on both ranks while training reaches ``trained_to``: the
    process, its gate (``gate / "open"`` lets the writes go) and its folder."""
    gate, folder = tmp_path / "gate", tmp_path / "ck"
    gate.mkdir()
    proc = job(folder, gate=gate)
    try:
        wait_until(lambda: held(gate, 10), timeout=180, what="both ranks' writes of step 10, held")
        proc.wait_event("progress", lambda e: e["step"] >= trained_to, timeout=120)  # training goes on meanwhile
    except BaseException:
        proc.kill()
        raise
    return proc, gate, folder


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The weights of every checkpoint of the run when each save is synchronous, by step."""
    folder = tmp_path_factory.mktemp("sync") / "ck"
    proc = job(folder, "--sync-save")
    assert proc.wait(300) == 0, proc.stderr[-3000:]
    assert [c.step for c in list_committed(folder)] == [10, 20, 30, 40]
    return {step: model_sha256(folder, step) for step in (10, 40)}


def test_the_loop_trains_on_while_a_sharded_checkpoint_is_written_and_it_holds_its_steps_state(
        tmp_path: Path, reference: dict[int, str]) -> None:
    proc, gate, folder = held_at_10(tmp_path, trained_to=16)
    with proc:
        assert list_committed(folder) == []
        (gate / "open").write_text("")
        code = proc.wait(240)
    assert code == 0, proc.stderr[-3000:]
    steps = [c.step for c in list_committed(folder)]
    assert steps[0] == 10 and steps[-1] == 40, steps
    assert model_sha256(folder, 10) == reference[10]  # the weights of step 10, not of the steps trained since
    assert model_sha256(folder, 40) == reference[40]


def test_a_failed_background_write_is_one_error_on_every_rank_and_the_previous_checkpoint_stays(
        tmp_path: Path) -> None:
    folder = tmp_path / "ck"
    proc = job(folder, gate=tmp_path, mode="fail:2:1")  # rank 1's second write finds the disk full
    code = proc.wait(240)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("job: error:")]
    assert code != 0 and len(errors) == 2, proc.stderr[-3000:]
    assert errors[0] == errors[1]
    assert "cannot write a sharded checkpoint" in errors[0] and "rank 1: No space left on device" in errors[0]
    assert "the previous checkpoint is untouched" in errors[0]
    assert [c.step for c in list_committed(folder)] == [10]
    assert open_checkpoint(folder)[1].step == 10  # verified: every file's digest checks out
    assert not [p.name for p in folder.iterdir() if p.name.startswith(STAGING_PREFIX)]
    assert [e["step"] for e in events(proc.stderr) if e.get("event") == "checkpoint"] == [10]


def test_a_sigterm_during_a_held_sharded_write_ends_on_the_stop_step_and_resumes_bit_exact(
        tmp_path: Path, reference: dict[int, str]) -> None:
    proc, gate, folder = held_at_10(tmp_path, trained_to=14)
    with proc:
        proc.signal(signal.SIGTERM)  # torchrun passes it on to both ranks; the write of step 10 is still held
        (gate / "open").write_text("")
        proc.wait(240)
    stopped = proc.wait_event("preempted")
    stop = stopped["step"]
    assert stopped["checkpoint_step"] == stop and 10 < stop < 40, stopped
    steps = [c.step for c in list_committed(folder)]
    assert steps[0] == 10 and steps[-1] == stop, steps
    assert model_sha256(folder, 10) == reference[10]

    restarted = job(folder)
    assert restarted.wait(300) == 0, restarted.stderr[-3000:]
    assert restarted.wait_event("resumed")["step"] == stop
    assert model_sha256(folder, 40) == reference[40]


def test_a_poll_after_each_step_commits_each_checkpoint_with_its_steps_state_in_reused_buffers(
        tmp_path: Path) -> None:
    """The loop's side of the API (job.app calls poll after every step), driven by tests.support.sharded_async_steps."""
    proc = JobProcess([*TORCHRUN, "--nproc-per-node", "2", "-m", "tests.support.sharded_async_steps", str(tmp_path)],
                      env=job_env())
    assert proc.wait(240) == 0, proc.stderr[-3000:]
    (report,) = [e for e in events(proc.stderr) if e.get("event") == "async_steps"]
    assert report["buffers_reused"] and report["in_flight_after_save"] == [True, True]
    assert [c.step for c in list_committed(tmp_path / "ck")] == [2, 4]
    for step in (2, 4):
        tree = load_state_file(*open_checkpoint(tmp_path / "ck" / checkpoint_name(step)))
        expected = torch.load(tmp_path / f"expected-{step}.pt", weights_only=True)
        assert tree["model"].keys() == expected["model"].keys()
        assert all(torch.equal(tree["model"][k], v) for k, v in expected["model"].items()), step
        optim = by_id(expected["optim"])
        for index, moments in optim["state"].items():
            saved = tree["optimizers"]["AdamW"]["state"][index]
            assert all(torch.equal(saved[k], v) for k, v in moments.items()), (step, index)
