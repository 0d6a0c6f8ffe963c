"""job.leavable's waits, each rank a thread with its own Waits on one real TCPStore (torch.distributed's,
on a free loopback port): the outcomes the multi-node tests cannot time, the races among them included."""
from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch.distributed as dist

from job import leavable
from job.exceptions import (EXIT_BAD_CHECKPOINT, EXIT_PREEMPTED, CheckpointLoadError, OtherRankError,
                            StoppedBeforeTraining, exit_code_for)
from job.leavable import Waits, WaitTimedOut

WHAT = "download their parts of the checkpoint"


@pytest.fixture
def store() -> Iterator[dist.Store]:
    yield dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))


def ranks(store: dist.Store, world: int, stopped: Callable[[int], str | None] = lambda rank: None,
          timeout_s: float = 30.0) -> list[Waits]:
    waits = [Waits(store, rank, world, timeout_s) for rank in range(world)]
    for rank, wait in enumerate(waits):
        wait.stopped = lambda rank=rank: stopped(rank)
    return waits


def outcome(wait: Waits) -> str:
    """What one rank's arrive ended with."""
    try:
        wait.arrive(WHAT)
    except (StoppedBeforeTraining, OtherRankError) as e:
        assert exit_code_for(e) == EXIT_PREEMPTED
        return type(e).__name__
    return "arrived"


def test_every_rank_arrived_goes_on_and_each_wait_is_a_new_one(store: dist.Store) -> None:
    waits = ranks(store, 3)
    with ThreadPoolExecutor(3) as pool:
        for _ in range(2):
            assert list(pool.map(outcome, waits)) == ["arrived"] * 3
    assert [wait.count for wait in waits] == [2, 2, 2] and store.add("2/arrived", 0) == 3
    assert all(wait.left() is None for wait in waits)


def test_a_rank_stopped_while_it_waits_leaves_and_every_other_rank_and_download_hears_it(store: dist.Store) -> None:
    stop = threading.Event()
    waits = ranks(store, 3, lambda rank: "SIGTERM" if rank == 0 and stop.is_set() else None)
    with ThreadPoolExecutor(2) as pool:
        first = [pool.submit(outcome, waits[r]) for r in (0, 1)]  # rank 2 is still downloading
        stop.set()
        assert [f.result() for f in first] == ["StoppedBeforeTraining", "OtherRankError"]
    assert waits[2].left() == "rank 0 stopped (SIGTERM)"  # its download gives up (job.storage.Pull)
    with pytest.raises(OtherRankError, match=r"^rank 0 stopped \(SIGTERM\) before training, while the ranks waited"):
        waits[2].arrive(WHAT)


def test_a_stop_after_every_rank_arrived_does_not_leave_the_collective_the_others_enter(store: dist.Store) -> None:
    """The last rank's arrival settles the wait: a rank that sees its stop only then goes on with the others
    (its stop is answered after the collective), or the others would wait in one it never enters."""
    waits = ranks(store, 2, lambda rank: "SIGTERM" if rank == 0 else None)
    waits[1].stopped = None  # rank 1 arrives without waiting: its count, then rank 0's settles the wait
    waits[1].count += 1
    store.add(f"{waits[1].count}/arrived", 1)
    assert outcome(waits[0]) == "arrived"
    assert waits[1].left() is None


def test_stops_on_every_rank_at_once_settle_one_outcome(store: dist.Store) -> None:
    waits = ranks(store, 4, lambda rank: "SIGTERM")
    with ThreadPoolExecutor(4) as pool:
        ended = list(pool.map(outcome, waits))
    assert sorted(ended) in (["OtherRankError"] * 3 + ["StoppedBeforeTraining"], ["arrived"] * 4)


def test_a_rank_that_never_comes_ends_the_wait_at_the_collective_timeout(store: dist.Store) -> None:
    waits = ranks(store, 2, timeout_s=0.3)
    with pytest.raises(WaitTimedOut, match=r"^rank\(s\) 1 did not come within 0s while the others waited to "
                                           r"download their parts of the checkpoint: stuck or gone"):
        waits[0].arrive(WHAT)


class GoneStore:
    """A store whose host has exited, as torch reports it."""

    def __getattr__(self, name: str) -> Callable[..., object]:
        def fail(*args: object) -> object:
            raise dist.DistNetworkError("Failed to recv, got 0 bytes. Connection was likely closed.")
        return fail


def test_a_store_whose_host_is_gone_is_another_node_that_left() -> None:
    wait = ranks(GoneStore(), 2)[0]
    with pytest.raises(OtherRankError, match=r"^the rendezvous store is gone \(Failed to recv.*another node has left"):
        wait.arrive(WHAT)
    assert (wait.left() or "").startswith("the rendezvous store is gone")


def test_without_a_stop_check_a_wait_is_only_the_collective(store: dist.Store) -> None:
    """During training stops are answered with a checkpoint: no store traffic, nothing counted."""
    wait = ranks(store, 2)[0]
    wait.stopped = None
    wait.arrive(WHAT)
    assert wait.count == 0 and wait.left() is None


def test_a_rank_that_fails_before_it_arrives_ends_the_others_wait_with_its_exit_code(store: dist.Store) -> None:
    """Its gloo connection closing told the others at once; polling the store, they would wait for it to the
    collective timeout. Its failure settles the wait they are in (job.app calls fail on the way out)."""
    waits = ranks(store, 3)
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(waits[r].arrive, WHAT) for r in (1, 2)]
        assert waits[0].fail(CheckpointLoadError("the checkpoint's metadata is damaged"))
        for future in waiting:
            with pytest.raises(OtherRankError, match=r"^rank 0 failed \(the checkpoint's metadata is damaged\) before"):
                future.result()
            assert exit_code_for(future.exception()) == EXIT_BAD_CHECKPOINT


def test_a_timed_out_wait_is_settled_so_a_late_rank_does_not_go_on_alone(store: dist.Store) -> None:
    waits = ranks(store, 2, timeout_s=0.2)
    with pytest.raises(WaitTimedOut):
        waits[0].arrive(WHAT)
    waits[1].timeout_s = 30.0
    with pytest.raises(OtherRankError, match=r"^rank\(s\) 1 did not come within 0s before training, while the "
                                             r"ranks waited to download"):
        waits[1].arrive(WHAT)  # the last to arrive: it would have settled "all" and entered the collective alone


def test_this_process_waits_through_the_groups_store(store: dist.Store, monkeypatch: pytest.MonkeyPatch) -> None:
    """What job.distributed.init hands over (use), under the namespace it adds; leave_on(None) ends the leaving."""
    monkeypatch.setattr(leavable, "_waits", None)
    leavable.use(store, 0, 2, 30.0)
    leavable.leave_on(lambda: "SIGTERM")
    with pytest.raises(StoppedBeforeTraining, match=r"^stopped \(SIGTERM\) while waiting for the other ranks to"):
        leavable.arrive(WHAT)
    other = Waits(dist.PrefixStore(leavable.PREFIX, store), 1, 2, 30.0)
    other.stopped = lambda: None
    assert other.left() == "rank 0 stopped (SIGTERM)"
    leavable.leave_on(None)
    leavable.arrive(WHAT)  # training: no wait of its own, the collective alone
    assert leavable.left() is None
