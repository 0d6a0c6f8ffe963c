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


class WithTrainingHead(SlowMLP):
    """An auxiliary classifier used in training only, as GoogLeNet's and Inception's are: in eval mode its
    parameters get no gradient, and DDP (find_unused_parameters off) fails a step after a backward that
    left them without one. Its logits wait in ``self.extra`` for ``loss``: forward returns one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(2, self.classes)
        self.extra: torch.Tensor | None = None

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.extra = self.head(batch[0]) if self.training else None
        return super().forward(batch)

    def loss(self, outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        main = super().loss(outputs, batch)
        return main if self.extra is None else main + 0.3 * super().loss(self.extra, batch)


def with_training_head() -> torch.nn.Module:
    return WithTrainingHead()
