"""Built-in model and data: no download, learns visibly in seconds on two CPU cores.

They follow the same contract as user code (README, "Bring your own model and data"), so they are
also the reference implementation of that contract.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from job.deferred_init import skip_init_on_resume

SPIRAL_CLASSES = 3


def spirals(split: str) -> Dataset:
    """Three interleaved noisy spirals in 2-D: linearly inseparable, so accuracy must be learned.

    Generated from a fixed generator per split, independent of --seed, so every run sees the same data.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"unknown split {split!r}")
    n_per_class = 1024 if split == "train" else 256
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    xs, ys = [], []
    for c in range(SPIRAL_CLASSES):
        r = torch.rand(n_per_class, generator=g)
        theta = 4.0 * r + c * 2.0 * math.pi / SPIRAL_CLASSES + 0.25 * torch.randn(n_per_class, generator=g)
        xs.append(torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1))
        ys.append(torch.full((n_per_class,), c, dtype=torch.long))
    return TensorDataset(torch.cat(xs), torch.cat(ys))


class MLP(nn.Module):
    """A small classifier with dropout (so resuming must restore the RNG to be exact)."""

    def __init__(self, in_dim: int = 2, hidden: int = 128, depth: int = 3, classes: int = SPIRAL_CLASSES,
                 dropout: float = 0.1) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = in_dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout)]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)
        self.classes = classes

    def forward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.net(batch[0])

    def loss(self, outputs: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(outputs.float(), batch[1])

    def metrics(self, train: bool) -> dict[str, Metric]:
        return {"accuracy": MulticlassAccuracy(num_classes=self.classes, average="micro")}


@skip_init_on_resume  # its state_dict is all it computes with (job.deferred_init)
def mlp() -> nn.Module:
    return MLP()


@skip_init_on_resume
def mlp_large() -> nn.Module:
    """About 100M parameters on the same task: for GPU and checkpoint-speed benchmarks."""
    return MLP(hidden=4096, depth=7)
