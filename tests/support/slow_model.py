"""The built-in MLP, made slow per step, for tests that interrupt training at wall-clock moments.

A real model's step takes far longer than uploading a tiny checkpoint; this restores that ratio so
that "lost work" numbers mean what they would in production.
"""
from __future__ import annotations

import time

import torch

from job.builtin import MLP

STEP_SECONDS = 0.02


class SlowMLP(MLP):
    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if self.training:
            time.sleep(STEP_SECONDS)
        return super().forward(batch)


def build() -> torch.nn.Module:
    return SlowMLP()
