"""Whether the state a resume restored can be trained from: NaN or Inf in a trainable parameter or in its
optimizer state (the state of a run that diverged) makes every step NaN from the first one on. Since exit 8
job.checkpoint writes no such state, but an older version, another tool or a hand-made checkpoint can hold
one; without this check the run trained NaN until its next checkpoint, then stopped with exit 8 naming this
checkpoint as the newest good one to resume.

The check is one reading pass over the state (state.finite): 25 ms for a 400 MB state on a 2-core VM, which
before the first step would add 3 % to a resume from the bucket (bench/resume_startup.py, BENCHMARKS.md). So it
runs in a thread while the first step runs its forward and backward, which read the state (a module
that rescales its weights in forward, ``nn.Embedding(max_norm=...)``, keeps finite values finite and NaN
NaN), and is answered right before that step's optimizer update, the first write (Trainer's
``before_update``), or after the loop when no step ran (a run at its end already, a stop before the first
step), before anything is saved. Every rank checks what it holds (its own shards, when sharded) and learns
what any rank found, so that none trains on alone."""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from job import distributed
from job.exceptions import CheckpointLoadError
from job.restore import cannot_train_on
from state import State
from state.finite import MODEL, first_nonfinite, parameter_keys, trained_tensors

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class ResumedCheck:
    """Started once the checkpoint ``source`` is restored into ``state``; :meth:`answer` ends it."""

    def __init__(self, state: State, source: str) -> None:
        self._source = source
        self._found: str | None = None
        live = state.state_dict()  # on the training thread: the live tensors themselves, no copy
        named = list(trained_tensors(live, parameter_keys(live[MODEL], state.model)))
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, args=(named,), name="resumed-check", daemon=True)
        self._thread.start()

    def _run(self, named: list[tuple[str, torch.Tensor]]) -> None:
        try:
            self._found = first_nonfinite(named)
        except Exception as e:  # noqa: BLE001 - a check that fails must never refuse a healthy run
            logger.warning("the resumed state was not checked for NaN or Inf: %s", repr(e).splitlines()[0])

    def answer(self) -> None:
        """On every rank alike (a collective): wait for the check, then raise CheckpointLoadError (exit 6) on
        every rank if any rank found NaN or Inf. Nothing after the first call."""
        if self._thread is None:
            return
        self.close()
        mine = (None if self._found is None
                else str(cannot_train_on(self._source, f"its {self._found} holds NaN or Inf, as the state of a run "
                                                       "that diverged does")))
        found = [message for message in distributed.all_gather(mine) if message is not None]
        if found:
            raise CheckpointLoadError(mine or f"{found[0]} (seen by another rank)")

    def close(self) -> None:
        """Wait for the thread (a run that ends before its first update), so that no check is still reading
        the state when the process exits; the check is quick, a few seconds at the largest."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
