"""A --data set whose build draws from the global torch generator on rank 0 only (torchrun sets RANK).

The README allows a data set that draws when it is built: a start that deferred the model's initialisation
then builds again without deferring (job.build). Here only one rank sees that it must, and every rank has
to build again with it, or the ranks' collectives no longer match.
"""
from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

from job.builtin import spirals


def build(split: str) -> Dataset:
    if os.environ.get("RANK", "0") == "0":
        torch.rand(1)
    return spirals(split)
