"""Async checkpoints: the loop blocks only for the snapshot; what is written is the state at that moment.

The parameters and optimizer state are copied in the background while the next step runs its forward
and backward; the loop's optimizer step waits for that copy (Checkpointer.before_update)."""
from __future__ import annotations

import errno
import os
import threading
import time
from typing import Any, Callable

import pytest
import torch

from job import distributed, logs
from job.app import _stop_for_preemption, train
from job.cadence import CheckpointCadence
from job.build import build
from job.checkpoint import WRITER_NICE, Checkpointer, load_state_file
from job import snapshot
from job.exceptions import CheckpointWriteError
from job.loop import Trainer, to_device
from job.schedule import Interval
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


@pytest.fixture
def held_copy(monkeypatch):
    """Holds the background copy of the parameters and optimizer state until the test opens it:
    (copy started, open the copy)."""
    started, opened = threading.Event(), threading.Event()
    real = snapshot.copy_into

    def held(buf, src, alone=False):
        started.set()
        assert opened.wait(30)
        real(buf, src, alone)

    monkeypatch.setattr(snapshot, "copy_into", held)
    return started, opened


def test_written_checkpoint_is_the_state_at_snapshot_time(run, tmp_path, gate):
    state = run.state
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    assert ckpt.save_async(state) is True  # returns while the write is held
    assert ckpt.in_flight()
    ckpt.before_update()  # what the loop calls before its optimizer step
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


def test_the_background_writer_yields_the_cpu_to_training_from_its_first_copy_on(run, tmp_path, held_copy):
    copying, release = held_copy
    _after_one_step(run)  # the AdamW moments exist: there is a copy to hold
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert ckpt.save_async(run.state) is True
    assert copying.wait(30)  # the writer thread is in its first copy of a parameter
    writer = ckpt._writer
    assert writer is not None and writer.native_id is not None
    try:
        assert os.getpriority(os.PRIO_PROCESS, writer.native_id) == main_nice + WRITER_NICE
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice  # training's is unchanged
    finally:
        release.set()
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


def test_a_stop_names_the_checkpoint_committed_even_while_its_writer_still_runs(run, tmp_path, monkeypatch):
    """Between its commit and its thread's end (on_commit hands it to the upload, then the prune) the
    checkpoint is durable: a stop must name it, not the one before, which a sidecar would stop short at."""
    commit_open, committing, leave = threading.Event(), threading.Event(), threading.Event()
    real = local.commit

    def held_commit(staging, manifest):
        if manifest.step == 2:
            assert commit_open.wait(30)
        return real(staging, manifest)

    def on_commit(checkpoint):
        if checkpoint.step == 2:
            committing.set()
            assert leave.wait(30)

    monkeypatch.setattr(local, "commit", held_commit)
    ckpt = Checkpointer(tmp_path, keep=3, meta={}, on_commit=on_commit)
    cadence = CheckpointCadence(ckpt, ckpt_config(tmp_path))
    trainer, batches = _after_one_step(run, ckpt.before_update)
    cadence.take(run.state)  # step 1
    assert ckpt.wait(30)
    trainer.train_step(to_device(next(batches), run.device))
    cadence.take(run.state)  # step 2: held before its commit
    try:
        assert (cadence.writing_step(), cadence.kept_step()) == (2, 1)
        ckpt.before_update()  # step 3 at its optimizer step: the snapshot is settled, the writer may commit
        commit_open.set()
        assert committing.wait(30)
        assert ckpt.in_flight()  # its thread is still in on_commit...
        assert (cadence.writing_step(), cadence.kept_step()) == (None, 2)  # ...and it is the one kept
    finally:
        commit_open.set()
        leave.set()
    assert ckpt.wait(30)


@pytest.mark.parametrize("least_left, final_saved", [(3600.0, True), (0.0, False)], ids=["time", "no-time"])
def test_the_final_checkpoint_is_weighed_against_the_rank_with_the_least_time_left(
        run, tmp_path, monkeypatch, least_left: float, final_saved: bool) -> None:
    """Rank 0 may have more time than another rank: its node heard of the stop a step later than the node
    that was signalled. The final save is a collective that every rank must finish before its kill, so
    whether it fits is decided on the least time any rank has left, never on rank 0's alone."""
    other_rank = {float: least_left}  # the other rank's answer to each gather, by what is gathered
    monkeypatch.setattr(distributed, "all_gather", lambda obj: [obj, other_rank.get(type(obj))])
    events: dict[str, dict[str, Any]] = {}
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    cadence = CheckpointCadence(ckpt, ckpt_config(tmp_path))
    trainer, batches = _after_one_step(run, ckpt.before_update)
    cadence.take(run.state)  # step 1
    assert ckpt.wait(30)
    trainer.train_step(to_device(next(batches), run.device))  # step 2, not saved
    stop = StopRequest(grace_period=3600.0)
    stop.request("SIGTERM")  # this rank (rank 0) has an hour
    stop_listening = logs.subscribe(lambda name, fields: events.setdefault(name, fields))
    try:
        _stop_for_preemption(run.state, cadence, None, stop)
    finally:
        stop_listening()
    assert [c.step for c in local.list_committed(tmp_path)] == ([1, 2] if final_saved else [1])
    assert events["preempted"]["checkpoint_step"] == (2 if final_saved else 1)
    assert ("grace_too_short" in events) is not final_saved


def _optimizer_state(state: State) -> dict:
    return {(i, k): v.clone() for i, s in state.optimizers[0].state_dict()["state"].items() for k, v in s.items()}


def _after_one_step(run, before_update: Callable[[], None] = lambda: None) -> tuple[Trainer, Any]:
    """A trainer of ``run`` that has taken its first step (the AdamW moments exist), and the batches after it."""
    trainer = Trainer(run, Interval.parse("1000ba"), log_interval=10 ** 9, after_step=lambda state, ended: None,
                      before_update=before_update)
    run.sampler.set_epoch(0, 0)
    batches = iter(run.state.train_dataloader)
    trainer.train_step(to_device(next(batches), run.device))
    return trainer, batches


def _watched_trainer(run, ckpt: Checkpointer) -> tuple[Trainer, Any, threading.Event]:
    """:func:`_after_one_step` with ``ckpt.before_update`` before each optimizer step, and an event set (cleared
    until the next step) as one is reached."""
    reached = threading.Event()

    def before_update() -> None:
        reached.set()
        ckpt.before_update()

    trainer, batches = _after_one_step(run, before_update)
    reached.clear()
    return trainer, batches, reached


def _assert_saved_is(folder, model: dict, optimizer: dict, state: State) -> None:
    """The newest checkpoint in ``folder`` holds exactly these parameters and optimizer state."""
    saved = load_state_file(local.list_committed(folder)[-1].path)
    assert saved["model"].keys() == model.keys()
    for name, tensor in model.items():
        assert torch.equal(saved["model"][name], tensor), name
    saved_optimizer = saved["optimizers"][type(state.optimizers[0]).__qualname__]["state"]
    assert {(i, k) for i, s in saved_optimizer.items() for k in s} == optimizer.keys()
    for (i, k), tensor in optimizer.items():
        assert torch.equal(saved_optimizer[i][k], tensor), (i, k)


def test_the_next_forward_and_backward_run_while_the_parameters_are_copied_and_the_optimizer_step_waits(
        run, tmp_path, held_copy):
    copying, release = held_copy
    state = run.state
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    trainer, batches, reached_update = _watched_trainer(run, ckpt)
    forwards = []
    state.model.register_forward_hook(lambda module, args, out: forwards.append(out.detach().clone()))
    model_at_1, optimizer_at_1 = {k: v.clone() for k, v in state.model.state_dict().items()}, _optimizer_state(state)
    assert optimizer_at_1
    reached_update.clear()

    assert ckpt.save_async(state) is True  # returns with the copy of the parameters held
    assert copying.wait(30)
    step_2 = threading.Thread(target=trainer.train_step, args=(to_device(next(batches), run.device),))
    step_2.start()
    try:
        assert reached_update.wait(30)  # step 2's forward and backward ran while the copy was held...
        assert len(forwards) == state.grad_accum and state.timer.batch.value == 1
        assert step_2.is_alive()  # ...and its optimizer step waits for the copy
        for name, tensor in state.model.state_dict().items():
            assert torch.equal(tensor, model_at_1[name]), name
    finally:
        release.set()
        step_2.join(30)
    assert not step_2.is_alive() and state.timer.batch.value == 2
    assert any(not torch.equal(v, model_at_1[k]) for k, v in state.model.state_dict().items())  # it stepped
    assert ckpt.wait(30)
    _assert_saved_is(tmp_path, model_at_1, optimizer_at_1, state)


@pytest.fixture
def writer_held_in_its_first_copy(monkeypatch):
    """The writer thread's first deferred copy waits until the test opens it; the training thread's copies
    are recorded, and raise ``fail_loop`` when set: (writer copying, open it, copies by the loop, fail_loop)."""
    started, opened = threading.Event(), threading.Event()
    by_loop: list[torch.Tensor] = []
    fail_loop: list[BaseException] = []
    real = snapshot.copy_into

    def copy(buf, src, alone=False):
        if alone:
            assert threading.current_thread() is not threading.main_thread()
            if not started.is_set():
                started.set()
                assert opened.wait(30)
        else:
            assert threading.current_thread() is threading.main_thread()
            if fail_loop:
                raise fail_loop[0]
            by_loop.append(src)
        real(buf, src, alone)

    monkeypatch.setattr(snapshot, "copy_into", copy)
    return started, opened, by_loop, fail_loop


def _deferred_count(state: State) -> int:
    """How many tensors job.snapshot's rule leaves for later: the parameters and the optimizer's tensors."""
    optimizer = state.optimizers[0]
    return (sum(1 for _ in state.model.parameters())
            + sum(1 for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)))


def test_the_loop_copies_what_the_writer_has_not_started_and_waits_only_for_the_rest(
        run, tmp_path, writer_held_in_its_first_copy):
    writer_copying, open_it, by_loop, _ = writer_held_in_its_first_copy
    state = run.state
    _after_one_step(run)
    model_at_1, optimizer_at_1 = {k: v.clone() for k, v in state.model.state_dict().items()}, _optimizer_state(state)
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    assert ckpt.save_async(state) is True
    assert writer_copying.wait(30)
    threading.Timer(0.5, open_it.set).start()  # the writer's copy ends only after the loop got there
    ckpt.before_update()  # in this (the training) thread
    assert open_it.is_set()  # it waited for the writer's copy...
    assert len(by_loop) == _deferred_count(state) - 1 > 0  # ...and copied every other one itself
    assert len({t.data_ptr() for t in by_loop}) == len(by_loop)  # each once
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)  # the optimizer step
    assert ckpt.wait(30)
    _assert_saved_is(tmp_path, model_at_1, optimizer_at_1, state)


def test_a_large_tensor_is_copied_in_pieces_and_the_loop_waits_only_for_the_writers_piece(
        writer_held_in_its_first_copy, monkeypatch):
    writer_copying, open_it, by_loop, _ = writer_held_in_its_first_copy
    monkeypatch.setattr(snapshot, "PIECE_BYTES", 1024)  # 256 float32s
    tree = {"big": torch.randn(1000), "transposed": torch.randn(3, 5).t()}  # the latter needs torch's copy: whole
    expected = {k: v.clone() for k, v in tree.items()}
    copied, _, deferred = HostSnapshot().capture_pipelined(tree, lambda path, tensor: True)
    writer = threading.Thread(target=deferred.run)
    writer.start()
    assert writer_copying.wait(30)  # in big's first piece
    threading.Timer(0.5, open_it.set).start()
    deferred.block_writes()
    assert open_it.is_set()
    assert sorted(t.numel() for t in by_loop) == [15, 232, 256, 256]
    writer.join(30)
    assert all(torch.equal(copied[k], v) for k, v in expected.items())


def test_a_copy_that_fails_in_the_loop_is_raised_there_and_nothing_is_written(
        run, tmp_path, writer_held_in_its_first_copy):
    writer_copying, open_it, _, fail_loop = writer_held_in_its_first_copy
    _after_one_step(run)
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    assert ckpt.save_async(run.state) is True
    assert writer_copying.wait(30)
    fail_loop.append(MemoryError("no memory for the copy"))
    try:
        with pytest.raises(MemoryError, match="no memory for the copy"):
            ckpt.before_update()
    finally:
        open_it.set()
    assert ckpt.wait(30)  # the writer ended without writing half a snapshot
    assert local.list_committed(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("make", [
    lambda: torch.randn(64, 33),
    lambda: torch.randn(64, 33).to(torch.bfloat16),
    lambda: torch.arange(1000, dtype=torch.int64),
    lambda: torch.randn(33, 64).t(),  # not contiguous
    lambda: torch.randn(8, 8, dtype=torch.complex64).conj(),  # a lazy conjugate
    lambda: torch.randn(8, 8)._neg_view(),  # a lazy negation (what .conj().imag gives, but contiguous)
    lambda: torch.empty(0, 5),
    lambda: torch.tensor(3.5),
], ids=["float32", "bfloat16", "int64", "transposed", "conj", "neg", "empty", "scalar"])
def test_a_copy_alone_gives_what_torchs_copy_gives(make):
    src = make()
    buf = torch.full(src.shape, 7, dtype=src.dtype) if src.numel() else torch.empty(src.shape, dtype=src.dtype)
    snapshot.copy_into(buf, src, alone=True)
    assert torch.equal(buf, src.resolve_conj().resolve_neg())
    assert not buf.is_conj() and not buf.is_neg()


def _threads_after_copying(alone: bool) -> int:
    """How many threads were started while a fresh thread made one large copy (it is still alive). New
    thread ids, not a count: an earlier test's threads may end meanwhile."""
    src, buf = torch.randn(1 << 22), torch.empty(1 << 22)
    counts: list[int] = []

    def copy() -> None:
        before = set(os.listdir("/proc/self/task"))
        snapshot.copy_into(buf, src, alone=alone)
        counts.append(len(set(os.listdir("/proc/self/task")) - before))

    thread = threading.Thread(target=copy)
    thread.start()
    thread.join(30)
    assert torch.equal(buf, src)
    return counts[0]


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or "OpenMP" not in torch.__config__.parallel_info(),
                    reason="counts the threads of torch's OpenMP teams in /proc")
def test_a_copy_alone_brings_no_openmp_team_of_its_own():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # what a new thread's team would be: training's size
    try:
        assert _threads_after_copying(alone=False) >= 1  # torch's copy: a team of two, one thread more
        assert _threads_after_copying(alone=True) == 0
    finally:
        torch.set_num_threads(threads)


def test_before_update_does_nothing_when_no_copy_is_running(run, tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    ckpt.before_update()  # nothing taken yet
    assert ckpt.last_stall_seconds is None
    assert ckpt.save_async(run.state) is True
    assert ckpt.wait(30)  # the copy is over with the write
    stall = ckpt.last_stall_seconds

    def no_copy(buf, src, alone=False):
        raise AssertionError("before_update copied")

    monkeypatch.setattr(snapshot, "copy_into", no_copy)
    ckpt.before_update()
    assert ckpt.last_stall_seconds == stall


def test_only_parameters_and_optimizer_state_are_copied_later():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    tree = {"model": model.state_dict(), "optimizers": {"AdamW": optimizer.state_dict()},
            "rng": {"torch": torch.get_rng_state()}}
    later = snapshot.written_by_update([optimizer])
    specs = HostSnapshot().specs(tree)
    assert {path for path, *_ in specs if later(path, _at(tree, path))} == {
        ("model", "0.weight"), ("model", "0.bias"), ("model", "1.weight"), ("model", "1.bias"),
        *(("optimizers", "AdamW", "state", i, k) for i in range(4) for k in ("step", "exp_avg", "exp_avg_sq"))}
    # the running statistics change in forward: copied with the rest, at once
    copied, _, deferred = HostSnapshot().capture_pipelined(tree, later)
    assert torch.equal(copied["model"]["1.running_mean"], model.state_dict()["1.running_mean"])
    deferred.run()
    assert all(torch.equal(copied["model"][k], v) for k, v in model.state_dict().items())


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def test_a_snapshot_whose_parameter_the_next_forward_wrote_is_discarded_and_taken_again(tmp_path, held_copy, caplog):
    """nn.Embedding(max_norm=...) renormalizes its rows in forward. Its copy, left to the writer and finished
    after step 2's forward, held step 2's rows in a checkpoint of step 1: a resume from it was not bit-exact.
    Such a snapshot is discarded (its step reported once), and the next one copies the embedding at once."""
    copying, release = held_copy
    run = build(train_config(model="tests.support.renorm_model:build"))
    state = run.state
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    trainer, batches, reached_update = _watched_trainer(run, ckpt)
    assert ckpt.save_async(state) is True  # step 1's, its writer held in its first copy
    assert copying.wait(30)
    step_2 = threading.Thread(target=trainer.train_step, args=(to_device(next(batches), run.device),))
    step_2.start()
    assert reached_update.wait(30)  # step 2's forward renormalized the embedding; the loop copies what is left
    release.set()
    step_2.join(30)
    assert ckpt.wait(30)
    assert local.list_committed(tmp_path) == []
    assert ckpt.take_discarded() == 1 and ckpt.take_discarded() is None
    assert "checkpoint of step 1 discarded: model.quadrant.weight changed between two optimizer steps" in caplog.text

    model_at_2, optimizer_at_2 = {k: v.clone() for k, v in state.model.state_dict().items()}, _optimizer_state(state)
    reached_update.clear()
    assert ckpt.save_async(state) is True  # step 2's: the embedding copied now, the rest later as before
    step_3 = threading.Thread(target=trainer.train_step, args=(to_device(next(batches), run.device),))
    step_3.start()
    assert reached_update.wait(30)
    step_3.join(30)
    assert ckpt.wait(30) and ckpt.take_discarded() is None
    _assert_saved_is(tmp_path, model_at_2, optimizer_at_2, state)


def test_every_checkpoint_of_a_model_that_writes_in_forward_is_the_state_of_its_step(tmp_path, monkeypatch):
    """Each writer's copy made to wait for the next step's forward (a busy node's nice +10 writer): every
    checkpoint committed still equals the durable one of an uninterrupted --sync-save run at that step. (Each
    save_async first lets the last writer finish, so that one is taken at every step it is due.)"""
    in_block_writes = threading.Event()
    real_block, real_copy, real_save = snapshot.Deferred.block_writes, snapshot.copy_into, Checkpointer.save_async

    def block_writes(self):
        in_block_writes.set()
        real_block(self)

    def late_copy(buf, src, alone=False):
        if alone:
            in_block_writes.wait(5)
        real_copy(buf, src, alone)

    def paced_save(self, state):
        if self._writer is not None:
            self._writer.join(30)  # settled by this step's before_update: it commits or discards, then ends
        return real_save(self, state)

    config = train_config(model="tests.support.renorm_model:build", max_duration="12ba")
    train(config, ckpt_config(tmp_path / "sync", interval="1ba", keep=100, async_save=False))
    monkeypatch.setattr(snapshot.Deferred, "block_writes", block_writes)
    monkeypatch.setattr(snapshot, "copy_into", late_copy)
    monkeypatch.setattr(Checkpointer, "save_async", paced_save)
    train(config, ckpt_config(tmp_path / "async", interval="1ba", keep=100))

    reference = {c.step: load_state_file(c.path) for c in local.list_committed(tmp_path / "sync")}
    written = {c.step: load_state_file(c.path) for c in local.list_committed(tmp_path / "async")}
    for step, saved in written.items():
        for part in ("model", "optimizers"):
            assert _tensors(saved[part]) == _tensors(reference[step][part]), (step, part)
    assert sorted(written) == list(range(2, 13))  # step 1's discarded (its embedding written in step 2), then each


def _tensors(tree: Any) -> list[tuple[str, bytes]]:
    """Every tensor of ``tree`` with its path, as bytes (equal bytes: bit for bit)."""
    if isinstance(tree, torch.Tensor):
        return [("", tree.numpy().tobytes())]
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else []
    return [(f"{k}/{p}", b) for k, v in items for p, b in _tensors(v)]


def test_a_writes_seconds_leave_out_its_wait_for_the_next_step(run, tmp_path, monkeypatch):
    """The writer waits for the next step's verdict before it commits (job.snapshot). Counted as writing, a slow
    step made the write look as long as the step, and a stop then found no time for its final checkpoint."""
    class Clock:  # job.checkpoint's perf_counter, moved by the test alone
        now = 1000.0

        def perf_counter(self) -> float:
            return self.now

    clock, waiting, real_wait = Clock(), threading.Event(), snapshot.Deferred.wait_settled

    def wait_settled(self):
        waiting.set()
        return real_wait(self)

    monkeypatch.setattr("job.checkpoint.time", clock)
    monkeypatch.setattr(snapshot.Deferred, "wait_settled", wait_settled)
    _after_one_step(run)
    ckpt = Checkpointer(tmp_path, keep=3, meta={})
    assert ckpt.save_async(run.state)
    assert waiting.wait(30)  # written, waiting for the verdict
    clock.now += 100.0  # the next step's forward and backward
    ckpt.before_update()
    assert ckpt.wait(30) and local.list_committed(tmp_path)
    assert ckpt.last_write_seconds == 0.0
