"""A --model with state of its own on each rank: buffers its forward updates from the rank's batches, as
BatchNorm's running statistics are. Under FSDP2 nothing makes the ranks' buffers equal (DDP broadcasts rank
0's at every forward), so a resume must give each rank its own back. ``shift`` is used in training too, so a
rank that resumed with another rank's buffers trains other weights. It records what it trains on as
tests.support.recording_model does (use that module's ``dataset``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.support.recording_model import RecordingMLP


class RunningShift(nn.Module):
    """Subtracts a running mean of its inputs, kept in a buffer and updated in training."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


class WithNorm(RecordingMLP):
    def __init__(self) -> None:
        super().__init__(dropout=0.0)
        self.shift = RunningShift(2)
        self.norm = nn.BatchNorm1d(2)

    def forward(self, batch: Any) -> torch.Tensor:
        return super().forward((self.norm(self.shift(batch[0])), *batch[1:]))


def build() -> nn.Module:
    return WithNorm()
