"""Waits for the other ranks that a stopped rank can leave, before training starts.

Why: before the first step, one node's work can take minutes while the others wait for it in a
collective: its part of the checkpoint downloading (job.node_pull), the whole checkpoint pulled onto it
(job.resume), rank 0 choosing and pulling the newest (decided_by_first). A gloo or NCCL collective
waits in C++, where no Python signal handler runs, so a node reclaimed while it waited answered its
SIGTERM only once the slowest node's download had ended: minutes past the grace period, then exit 5
from a download given up (review 49, defect 6).

So before such a collective every rank first *arrives* through the process group's own store
(torch.distributed's TCPStore, the one torchrun's rendezvous set up), polling it and its stop request
in Python. Every rank arrived: the collective follows and returns at once. A rank stopped first: it
settles the wait as left and exits 75 (nothing trained, nothing to save), and the others hear it at their
next poll and exit 75 too, as do downloads still running elsewhere (:func:`left`, polled by
job.storage.Pull). A rank that fails instead settles the wait with its exit code (:meth:`Waits.fail`).
One key per wait, set once with compare-and-set, decides between the outcomes, so no rank enters the
collective that another has left. Training answers stops in its own way (the per-step agree, then a
checkpoint), so waits leave only while a stop check is installed (:func:`leave_on`, from the resume in
job.app.train to its first step).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from torch.distributed import DistNetworkError, PrefixStore

from job.exceptions import EXIT_PREEMPTED, JobError, OtherRankError, StoppedBeforeTraining, exit_code_for
from job.safe_load import first_line

logger = logging.getLogger(__name__)

POLL_S = 0.05  # how often a waiting rank first looks at the store and at its stop request
POLL_MAX_S = 0.5  # ... backing off to this: a wait of minutes on a thousand ranks is not a flood on the store
ALL = "all"  # a wait's outcome when every rank arrived; otherwise "<exit code> <who ended it, and why>"
PREFIX = "spot-trainer/leavable"


class WaitTimedOut(JobError):
    """A rank never arrived within the group's collective timeout: stuck, or gone without a word."""

    def __init__(self, who: str, what: str) -> None:
        super().__init__(f"{who} while the others waited to {what}: stuck or gone (kill -USR1 a worker to see "
                         "where it waits)")
        self.who = who  # what the other ranks are told


class Waits:
    """One rank's side of the waits; every rank makes the same waits in the same order, so a count names
    the same wait on all of them."""

    def __init__(self, store: Any, rank: int, world: int, timeout_s: float) -> None:
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self.stopped: Callable[[], str | None] | None = None  # leave_on
        self.count = 0
        self._waiting = False  # inside a wait: a failure settles this one, not the next (fail)

    def arrive(self, what: str) -> None:
        """Collective: return once every rank has arrived here, or raise StoppedBeforeTraining (this rank
        stopped first), OtherRankError (another rank stopped or failed: its exit code) or WaitTimedOut.
        A no-op without a stop check."""
        if self.world < 2 or self.stopped is None:
            return
        self.count += 1
        self._waiting = True
        try:
            self._wait(f"{self.count}", what, self.stopped)
        except DistNetworkError as e:  # the store's host (torchrun's agent on the first node, or rank 0) is gone
            raise OtherRankError(f"the rendezvous store is gone ({first_line(e, 200)}) while the ranks waited to "
                                 f"{what}: another node has left", EXIT_PREEMPTED) from None
        finally:
            self._waiting = False

    def fail(self, error: BaseException) -> bool:
        """This rank ends with ``error`` before training: settle the wait the others are in, or will reach
        next, with its exit code, so that they end with it now. Without this they would wait for this rank
        to the collective timeout, where a gloo collective heard of its closed connection at once. A rank
        killed without a word (SIGKILL, the OOM killer) still leaves them to the timeout, unless JobSet
        (restarting the set when a pod fails) or torchrun's agent (with --max-restarts) stops them first.
        True where this settled the wait."""
        if self.world < 2 or self.stopped is None:
            return False
        key = f"{self.count if self._waiting else self.count + 1}"
        why = error.who if isinstance(error, WaitTimedOut) else f"rank {self.rank} failed ({first_line(error, 300)})"
        try:
            return self._settle(key, exit_code_for(error), why)
        except RuntimeError as e:  # the store is gone too: the others hear of it from there
            logger.debug("could not tell the other ranks of this rank's failure: %s", e)
            return False

    def _settle(self, key: str, code: int, why: str) -> bool:
        """The wait's outcome, unless it has one already; True where it is now this one (two ranks that time
        out alike both get True, and end alike)."""
        mine = f"{code} {why}"
        return bool(self.store.compare_set(f"{key}/outcome", "", mine).decode() == mine)

    def left(self) -> str | None:
        """Why the job stops because another rank left a wait; None while none has."""
        if self.world < 2 or self.stopped is None:
            return None
        try:
            return self.store.get("left").decode() if self.store.check(["left"]) else None
        except DistNetworkError as e:  # the store's host is gone: so is the node that held it
            return f"the rendezvous store is gone ({first_line(e, 200)})"

    def _wait(self, key: str, what: str, stopped: Callable[[], str | None]) -> None:
        store, outcome = self.store, f"{key}/outcome"
        deadline, delay = time.monotonic() + self.timeout_s, POLL_S
        store.append(f"{key}/came", f"{self.rank},")  # a timeout names who did not, with one read
        if store.add(f"{key}/arrived", 1) == self.world:
            store.compare_set(outcome, "", ALL)
        while True:
            if store.check([outcome]):
                settled = store.get(outcome).decode()
                if settled == ALL:
                    return
                code, _, why = settled.partition(" ")
                raise OtherRankError(f"{why} before training, while the ranks waited to {what}", int(code))
            why = stopped()
            if why is not None:
                mine = f"rank {self.rank} stopped ({why})"
                if self._settle(key, EXIT_PREEMPTED, mine):
                    logger.debug("leaving the wait to %s: %s", what, mine)
                    store.set("left", mine)  # for downloads still running on other nodes (left())
                    raise StoppedBeforeTraining(f"stopped ({why}) while waiting for the other ranks to {what}, "
                                                "before any training: nothing new to save")
                continue  # every rank had arrived first, or another rank left first: the outcome says which
            if time.monotonic() > deadline:
                came = {int(r) for r in store.get(f"{key}/came").decode().split(",") if r}
                missing = [r for r in range(self.world) if r not in came]
                timed_out = WaitTimedOut(f"rank(s) {_listed(missing)} did not come within {self.timeout_s:.0f}s"
                                         if missing else f"the ranks came only after {self.timeout_s:.0f}s", what)
                if self.fail(timed_out):  # a late rank must not go on into a collective with ranks that are gone
                    raise timed_out
                continue  # settled first by another rank: the outcome says how
            time.sleep(delay)
            delay = min(POLL_MAX_S, delay * 1.5)


def _listed(ranks: list[int], most: int = 8) -> str:
    shown = ", ".join(str(r) for r in ranks[:most])
    return shown + (f" and {len(ranks) - most} more" if len(ranks) > most else "")


_waits: Waits | None = None  # this process's, once it has joined a process group (use)


def use(store: Any, rank: int, world: int, timeout_s: float) -> None:
    """Called by job.distributed.init with the store the process group was made with."""
    global _waits
    _waits = Waits(PrefixStore(PREFIX, store), rank, world, timeout_s)


def leave_on(stopped: Callable[[], str | None] | None) -> None:
    """Install the stop check (why this rank must stop, None while it need not); None: waits no longer leave."""
    if _waits is not None:
        _waits.stopped = stopped


def arrive(what: str) -> None:
    """:meth:`Waits.arrive` of this process; a no-op outside a process group."""
    if _waits is not None:
        _waits.arrive(what)


def fail(error: BaseException) -> None:
    """:meth:`Waits.fail` of this process; a no-op outside a process group."""
    if _waits is not None:
        _waits.fail(error)


def left() -> str | None:
    """Why the job is stopping because another rank left a wait (None while none has): a download that
    would only end in a collective nobody else enters gives up on it (job.storage.Pull)."""
    return _waits.left() if _waits is not None else None
