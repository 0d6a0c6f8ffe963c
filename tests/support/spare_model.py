"""A --model with a child its forward never uses (a head for another task, a layer switched off): that
parameter never gets a gradient, so AdamW keeps no state for it and a checkpoint holds none. It records
what it trains on as tests.support.recording_model does (use that module's ``dataset``)."""
from __future__ import annotations

from torch import nn

from tests.support.recording_model import RecordingMLP


class WithSpare(RecordingMLP):
    def __init__(self) -> None:
        super().__init__(dropout=0.0)
        self.spare = nn.Linear(4, 4)


def build() -> nn.Module:
    return WithSpare()
