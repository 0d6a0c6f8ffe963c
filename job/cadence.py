"""When the loop checkpoints: after each step, whether a checkpoint is due (--save-interval, or one owed),
and which checkpoint is durable or still being written when the run stops (job.app's preemption path)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from job.checkpoint import Checkpointer
from job.config import CheckpointConfig
from state import State

logger = logging.getLogger(__name__)


@dataclass
class CheckpointCadence:
    """Decides after each step whether a checkpoint is due, and takes it without stalling the loop.

    A due checkpoint that finds the previous one still being written stays due and is taken after a
    later step, as soon as the writer is free (the loop never waits for the disk).
    """

    checkpointer: Checkpointer
    cfg: CheckpointConfig
    last_step: int | None = None  # the step of the last checkpoint taken (it may still be being written)
    _previous_step: int | None = None
    _owed: bool = False
    _clock: float = field(default_factory=time.monotonic)

    def due(self, state: State, epoch_ended: bool) -> bool:
        return self._owed or self.cfg.interval.due(state.timer, epoch_ended, time.monotonic() - self._clock)

    def retake(self) -> None:
        """The last snapshot was found stale and discarded (job.checkpoint's take_discarded, on rank 0; every
        rank calls this alike): it never lands, so it is not the last one taken, and one is owed now."""
        self.last_step, self._owed = self._previous_step, True

    def take(self, state: State) -> None:
        """A snapshot now, written in the background; stays owed while the previous write is in flight."""
        if self.saved_now(state):
            return
        if not self.cfg.async_save:
            self.save_durable(state)
            return
        self._owed = not self.checkpointer.save_async(state)
        if self._owed:
            logger.debug("checkpoint at step %d deferred: the previous one is still being written",
                         state.timer.batch.value)
        else:
            self._taken(state)

    def save_durable(self, state: State) -> None:
        """This step's checkpoint, committed when this returns (end of training, preemption)."""
        if self.saved_now(state):
            self.checkpointer.wait()
        else:
            self.checkpointer.save(state)
            self._taken(state)

    def _taken(self, state: State) -> None:
        self._previous_step, self.last_step = self.last_step, state.timer.batch.value
        self._owed = False
        self._clock = time.monotonic()

    def kept_step(self) -> int | None:
        """The newest checkpoint that is durable now: the last one taken, unless it is still being written.
        Committed, it counts even while its thread finishes (on_commit, the prune): naming the one before
        would leave a sidecar free to stop short of it."""
        return self._previous_step if self.writing_step() is not None else self.last_step

    def writing_step(self) -> int | None:
        """The step of the checkpoint still being written, not yet committed: it may still land."""
        if self.checkpointer.in_flight() and self.checkpointer.last_committed != self.last_step:
            return self.last_step
        return None

    def saved_now(self, state: State) -> bool:
        return self.last_step == state.timer.batch.value

    def estimate_seconds(self, state: State) -> float:
        """How long a durable save will take: the last write, or the state's size at a conservative 200 MB/s."""
        if self.checkpointer.last_write_seconds is not None:
            return self.checkpointer.last_write_seconds
        tensors = list(state.model.parameters())
        for opt in state.optimizers:
            tensors += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors) / 200e6 + 0.2
