"""A model and data plugin that record which training samples were trained on (issue 17's exactly-once).

The dataset is the built-in spirals with each sample's index appended; the model is the built-in MLP,
slowed down like tests.support.slow_model so that signals land mid-epoch, and it appends the indices of
every micro-batch it trains on to a file of its own process in $RECORD_DIR (training mode only: neither
evaluation nor DDP's bucket warm-up, job.ddp_buckets.warming_up, is recorded). Recording in forward, not in
the dataset, counts what was trained, not what a DataLoader worker prefetched.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from job.builtin import MLP, spirals
from job.ddp_buckets import warming_up

STEP_SECONDS = 0.01


class Indexed(Dataset):  # type: ignore[type-arg]
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = self.inner[index]
        return x, y, index


class RecordingMLP(MLP):
    def forward(self, batch: Any) -> torch.Tensor:
        if self.training and not warming_up():  # DDP's bucket warm-up trains nothing (job.ddp_buckets)
            time.sleep(STEP_SECONDS)
            path = Path(os.environ["RECORD_DIR"]) / f"trained-{os.getpid()}.txt"
            with open(path, "a") as f:
                f.write("".join(f"{int(i)}\n" for i in batch[2]))
        return super().forward(batch[:2])

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return super().loss(outputs, batch[:2])


def build() -> torch.nn.Module:
    # No dropout: its random draws are per rank, so another rank count would draw others; without
    # randomness in the model, results on any rank count differ only by floating-point order.
    return RecordingMLP(dropout=0.0)


class TokenCounting(RecordingMLP):
    """Samples of different lengths: sample i counts ``tokens_of(i)`` tokens."""

    def num_tokens(self, batch: Any) -> int:
        return sum(tokens_of(int(i)) for i in batch[2])


def tokens_of(index: int) -> int:
    return index % 5 + 1


def build_counting_tokens() -> torch.nn.Module:
    return TokenCounting(dropout=0.0)


def dataset(split: str) -> Dataset:  # type: ignore[type-arg]
    return Indexed(spirals(split))


class Named(Indexed):
    """Samples that also carry a string id, as many datasets do (a file name): default_collate leaves the ids
    a list with one entry per sample, which gradient accumulation must cut like the tensors."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int, str]:  # type: ignore[override]
        return (*super().__getitem__(index), f"sample-{index}")


def named_dataset(split: str) -> Dataset:  # type: ignore[type-arg]
    return Named(spirals(split))


def trained(folder: Path) -> list[int]:
    """Every index trained on, by every process that recorded into ``folder``."""
    return [int(line) for path in sorted(folder.glob("trained-*.txt")) for line in path.read_text().split()]
