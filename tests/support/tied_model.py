"""A --model whose weights are tied across two of its top-level children, as a language model's token
embedding and output layer are (or ALBERT's layers): one parameter, two modules. It records what it
trains on as tests.support.recording_model does (use that module's ``dataset``)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from job.deferred_init import skip_init_on_resume
from tests.support.recording_model import RecordingMLP

WIDTH = 16


class Tied(RecordingMLP):
    """The recording MLP after two layers, ``first`` and ``second``, that share one weight (each with a
    bias of its own)."""

    def __init__(self) -> None:
        super().__init__(in_dim=WIDTH, hidden=WIDTH, depth=1, dropout=0.0)
        self.inp = nn.Linear(2, WIDTH)
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH)
        self.second.weight = self.first.weight

    def forward(self, batch: Any) -> torch.Tensor:
        hidden = torch.tanh(self.first(torch.tanh(self.inp(batch[0]))))
        return super().forward((torch.tanh(self.second(hidden)), *batch[1:]))


@skip_init_on_resume  # a resume builds it uninitialised, ties kept (job.deferred_init), then shards it
def build() -> nn.Module:
    return Tied()
