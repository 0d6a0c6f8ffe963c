"""One training job from start to finish: build, resume, train, checkpoint on cadence, finish.

The CLI hands in validated configs; this module wires the components and owns no policy of its own
beyond the order of events.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from job.build import build
from job.checkpoint import Checkpointer, open_checkpoint, restore
from job.config import CheckpointConfig, TrainConfig
from job.exceptions import ConfigError
from job.logs import event
from job.loop import Trainer
from state import State, TimeUnit
from uploader import local

logger = logging.getLogger(__name__)


def run_meta(cfg: TrainConfig) -> dict[str, Any]:
    """Recorded in every manifest: what a resume must match to be exact, and what wrote it."""
    return {
        "model": cfg.model,
        "data": cfg.data,
        "batch_size": cfg.batch_size,
        "seed": cfg.seed,
        "grad_accum": cfg.grad_accum,
        "world_size": 1,
        "torch": torch.__version__,
    }


@dataclass
class CheckpointCadence:
    """Decides after each step whether a checkpoint is due, and remembers what was saved last."""

    checkpointer: Checkpointer
    cfg: CheckpointConfig
    last_step: int | None = None
    _clock: float = field(default_factory=time.monotonic)

    def after_step(self, state: State, epoch_ended: bool) -> None:
        if self.cfg.interval.due(state.timer, epoch_ended, time.monotonic() - self._clock):
            self.save(state)

    def save(self, state: State) -> None:
        self.checkpointer.save(state)
        self.last_step = state.timer.batch.value
        self._clock = time.monotonic()

    def save_final(self, state: State) -> None:
        if self.last_step != state.timer.batch.value:
            self.save(state)


def resume(state: State, cfg: CheckpointConfig, checkpointer: Checkpointer, meta: dict[str, Any]) -> bool:
    if cfg.resume == "never":
        if local.list_committed(cfg.folder):
            logger.warning("--resume never: ignoring the checkpoints already in %s", cfg.folder)
        return False
    if cfg.resume == "auto":
        found = checkpointer.newest()
        if found is None:
            return False
        folder, manifest = found[0].path, found[1]
    else:
        folder, manifest = open_checkpoint(Path(cfg.resume))
    restore(state, folder, manifest, meta)
    event(logger, "resumed", step=state.timer.batch.value, epoch=state.timer.epoch.value, source=str(folder))
    return True


def train(cfg: TrainConfig, ckpt_cfg: CheckpointConfig,
          should_stop: Callable[[State], bool] = lambda state: False) -> State:
    """Train to max_duration (or until ``should_stop``), always ending with a committed checkpoint."""
    run = build(cfg)
    state = run.state
    if cfg.max_duration.unit == TimeUnit.TOKEN and not hasattr(state.model, "num_tokens"):
        raise ConfigError(f"--max-duration {cfg.max_duration} counts tokens, but --model {cfg.model!r} has no num_tokens(batch)")
    meta = run_meta(cfg)
    checkpointer = Checkpointer(ckpt_cfg.folder, ckpt_cfg.keep, meta)
    cadence = CheckpointCadence(checkpointer, ckpt_cfg)
    if resume(state, ckpt_cfg, checkpointer, meta):
        cadence.last_step = state.timer.batch.value
    local.clear_finished(ckpt_cfg.folder)
    event(logger, "start", step=state.timer.batch.value, max_duration=str(state.max_duration),
          device=cfg.device, precision=cfg.precision.value, parameters=sum(p.numel() for p in state.model.parameters()))
    Trainer(run, cfg.eval_interval, cfg.log_interval, after_step=cadence.after_step, should_stop=should_stop).fit()
    cadence.save_final(state)
    local.mark_finished(ckpt_cfg.folder, state.timer.batch.value)
    event(logger, "finished", step=state.timer.batch.value, epoch=state.timer.epoch.value,
          metrics={label: {k: round(float(v), 6) for k, v in m.items()} for label, m in state.current_metrics.items()})
    return state
