"""Async checkpoints: the loop blocks only for the snapshot; what is written is the state at that moment."""
from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

from job.app import train
from job.build import build
from job.checkpoint import WRITER_NICE, Checkpointer, load_state_file
from job.exceptions import CheckpointWriteError
from job.signals import StopRequest
from job.snapshot import HostSnapshot
from state import State
from tests.support.jobs import StopAtStep, ckpt_config, train_config
from tests.support.polling import wait_until
from uploader import local


@pytest.fixture
def run():
    return build(train_config())


@pytest.fixture
def gate(monkeypatch):
    """Holds every commit until the test opens the gate: a checkpoint stays 'in flight' on demand."""
    opened = threading.Event()
    real = local.commit

    def held_commit(staging, manifest):
        opened.wait(30)
        return real(staging, manifest)

    monkeypatch.setattr(local, "commit", held_commit)
    return opened


def test_written_checkpoint_is_the_state_at_snapshot_time(run, tmp_path, gate):
    state = run.state
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    assert ckpt.save_async(state) is True  # returns while the write is held
    assert ckpt.in_flight()
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)  # training goes on and changes the weights
    gate.set()
    assert ckpt.wait(30)
    saved = load_state_file(local.list_committed(tmp_path)[-1].path)["model"]
    for name, tensor in before.items():
        assert torch.equal(saved[name], tensor), name


def test_a_save_due_while_one_is_in_flight_is_deferred_not_waited_for(run, tmp_path, gate):
    state = run.state
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    assert ckpt.save_async(state) is True
    state.timer.on_batch_complete(samples=64)
    assert ckpt.save_async(state) is False  # nothing done: the caller retries after a later step
    gate.set()
    assert ckpt.wait(30)
    assert ckpt.save_async(state) is True
    assert ckpt.wait(30)
    assert [c.step for c in local.list_committed(tmp_path)] == [0, 1]


def test_a_background_write_failure_surfaces_in_the_training_thread(run, tmp_path, monkeypatch):
    def full_disk(staging, manifest):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(local, "commit", full_disk)
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    assert ckpt.save_async(run.state) is True
    with pytest.raises(CheckpointWriteError, match="No space left on device"):
        ckpt.wait(30)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(local.STAGING_PREFIX)]


def test_snapshot_buffers_are_reused_between_checkpoints(run):
    snap = HostSnapshot()
    first, _ = snap.capture(run.state.model.state_dict())
    ptrs = {k: v.data_ptr() for k, v in first.items()}
    second, _ = snap.capture(run.state.model.state_dict())
    assert {k: v.data_ptr() for k, v in second.items()} == ptrs  # about one extra copy of the state, not one per save
    assert all(first[k] is not v for k, v in run.state.model.state_dict().items())


def test_checkpointer_reserves_in_the_background_and_the_first_save_uses_it(run, tmp_path):
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    ckpt.reserve(run.state)
    assert ckpt.wait(30)  # the reservation is joined like a write in flight
    reserved = [b.data_ptr() for b in ckpt._snapshot._buffers.values()]
    assert len(reserved) == len(HostSnapshot().specs(run.state.state_dict())) > 0
    assert ckpt.save_async(run.state) is True
    assert ckpt.wait(30)
    assert [b.data_ptr() for b in ckpt._snapshot._buffers.values()] == reserved
    saved = load_state_file(local.list_committed(tmp_path)[-1].path)["model"]
    for name, tensor in run.state.model.state_dict().items():
        assert torch.equal(saved[name], tensor), name


def test_snapshot_keeps_every_non_tensor_leaf_exactly(run):
    tree = run.state.state_dict()
    copied, _ = HostSnapshot().capture(tree)
    assert copied["rng"]["python"] == tree["rng"]["python"]
    assert copied["timer"] == tree["timer"] and copied["current_metrics"] == tree["current_metrics"]
    assert torch.equal(copied["rng"]["torch"], tree["rng"]["torch"])


class FailAtStep(StopRequest):
    """A loop that fails (as a storage error raised after a step would) once it reaches ``step``."""

    def __init__(self, step: int) -> None:
        super().__init__(grace_period=float("inf"))
        self.step = step

    def should_stop(self, state: object = None) -> bool:
        if isinstance(state, State) and state.timer.batch.value >= self.step:
            raise RuntimeError(f"the loop failed at step {self.step}")
        return False


def test_a_failing_loop_lets_the_checkpoint_in_flight_finish_before_it_raises(tmp_path, monkeypatch):
    """Otherwise the process exits with the writer inside torch.save and the runtime aborts it (SIGABRT)."""
    real = local.commit

    def slow_commit(staging, manifest):
        time.sleep(0.5)  # the write of step 10 is still in flight when step 11 fails
        return real(staging, manifest)

    monkeypatch.setattr(local, "commit", slow_commit)
    with pytest.raises(RuntimeError, match="failed at step 11"):
        train(train_config(), ckpt_config(tmp_path, interval="10ba"), stop=FailAtStep(11))
    assert not [t.name for t in threading.enumerate() if t.name.startswith("checkpoint-")]
    assert [c.step for c in local.list_committed(tmp_path)] == [10]


def test_the_background_writer_yields_the_cpu_to_training(run, tmp_path, gate):
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert ckpt.save_async(run.state) is True  # held in commit: the writer thread is alive
    writer = ckpt._writer
    assert writer is not None and writer.native_id is not None
    try:
        wait_until(lambda: os.getpriority(os.PRIO_PROCESS, writer.native_id) == main_nice + WRITER_NICE,
                   what="the writer thread's nice value")
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice  # training's is unchanged
    finally:
        gate.set()
    assert ckpt.wait(30)


def test_a_stop_at_the_step_of_a_checkpoint_in_flight_waits_no_longer_than_the_grace(tmp_path, monkeypatch):
    """The step's checkpoint was taken just before the stop: finishing it is the best end, but only
    within the grace period; past it the job must leave (and say so) rather than be killed mid-write."""
    real = local.commit

    def slow_commit(staging, manifest):
        time.sleep(1.0)
        return real(staging, manifest)

    monkeypatch.setattr(local, "commit", slow_commit)
    outcome = train(train_config(), ckpt_config(tmp_path, interval="10ba"), stop=StopAtStep(10, grace_period=0.0))  # a SIGTERM with no grace left
    assert outcome.preempted and outcome.state.timer.batch.value == 10
    assert outcome.writing  # left in flight, not waited for
    assert local.read_finished(tmp_path) is None  # nothing durable to point a sidecar at
    wait_until(lambda: local.list_committed(tmp_path), what="the abandoned write to finish on its own")
    assert [c.step for c in local.list_committed(tmp_path)] == [10]
