"""Typed configuration, built once from the CLI options and validated at the edge.

Nothing below the CLI reads the environment: every module gets one of these dataclasses.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from job.schedule import Interval
from state import SEED_LIMIT, TIMER_LIMIT, Precision, Time, TimeUnit


# DataLoader processes per rank: more than any machine runs usefully (torch suggests one per CPU); a typo of
# 10**20 made the DataLoader fork until the machine ran out of processes, with no error.
MAX_WORKERS = 256


@dataclass(frozen=True)
class TrainConfig:
    model: str
    data: str
    max_duration: Time
    batch_size: int
    lr: float
    seed: int
    device: str  # resolved: "cpu" or "cuda"
    precision: Precision
    grad_accum: int
    eval_interval: Interval
    log_interval: int
    num_workers: int
    sharded: bool = False  # FSDP2: parameters and optimizer state sharded across ranks
    tensorboard: bool = True  # training curves as TensorBoard event files in the save folder (job.curves)

    def __post_init__(self) -> None:
        if self.max_duration.unit == TimeUnit.DURATION:
            raise ValueError("--max-duration cannot be in 'dur'; use ep, ba, sp or tok")
        if self.max_duration.value <= 0:
            raise ValueError("--max-duration must be positive")
        if self.max_duration.value >= TIMER_LIMIT:  # its checkpoints could not be resumed (state.time)
            raise ValueError(f"--max-duration {self.max_duration} is beyond the 2**62 a run counts to")
        if self.batch_size < 1:
            raise ValueError("--batch-size must be >= 1")
        if self.grad_accum < 1 or self.batch_size % self.grad_accum:
            raise ValueError(
                f"--grad-accum {self.grad_accum} must be >= 1 and divide --batch-size {self.batch_size}"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a positive finite number, not {self.lr}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"--seed must be between 0 and {SEED_LIMIT - 1}, not {self.seed}")
        if self.log_interval < 1:
            raise ValueError("--log-interval must be >= 1")
        if not 0 <= self.num_workers <= MAX_WORKERS:  # torch's DataLoader forks as many as it is told, forever
            raise ValueError(f"--num-workers must be from 0 to {MAX_WORKERS}, not {self.num_workers}")
        if self.precision != Precision.FP32 and self.device != "cuda":
            raise ValueError(
                f"--precision {self.precision.value} needs --device cuda (a GPU); use --precision fp32 on CPU"
            )


@dataclass(frozen=True)
class CheckpointConfig:
    folder: Path
    interval: Interval
    keep: int
    resume: str  # "auto", "never", or a path to a checkpoint folder
    async_save: bool = True  # False: every periodic checkpoint is durable before the next step (slower)

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise ValueError("--keep must be >= 1")
        if not self.resume.strip():  # Path("") is ".": an unset variable resumed whatever the working folder held
            raise ValueError("--resume is empty: give auto, never or a checkpoint folder")
