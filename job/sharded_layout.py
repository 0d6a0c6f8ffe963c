"""The parts of a sharded checkpoint outside DCP's files, which every run handles.

A resume of any run restores a rank's own buffers (job.restore). Neither that nor these names needs
torch.distributed.checkpoint (DCP), FSDP or DTensor, which job.sharded imports: so job.sharded is imported
only where a sharded checkpoint is written or read, and ``job inspect`` of an unsharded checkpoint takes
about 0.9 s less (BENCHMARKS.md, thirty-first session). A training process still imports FSDP and
DTensor, through torch._dynamo, which torch.optim's constructor imports; it is spared DCP.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

MODEL, OPTIMIZERS = "model", "optimizers"  # the State entries that DCP saves and reshards
BUFFERS = "buffers"  # each rank's own model buffers, in its rank file (own_buffers)


def rank_file(rank: int, world: int) -> str:
    """The file of one rank's own state (uploader.manifest.RANK_FILE_RE)."""
    return f"rank-{rank:05d}-of-{world:05d}.pt"


def own_buffers(model: torch.nn.Module, state_dict: Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """This rank's persistent buffers (BatchNorm's running statistics...), by state-dict name. FSDP2 shards
    parameters only and, unlike DDP, never makes the ranks' buffers equal: each rank's are its own state,
    updated from its own batches. DCP saves one copy of each (they look replicated), and loaded that one
    into every rank: a resume on as many ranks trained on with other statistics. So each rank also keeps
    its own in its rank file, put back by job.restore. ``state_dict``: the model's, where the caller has it
    already (a save): its names say which buffers are persistent."""
    persistent = (model.state_dict() if state_dict is None else state_dict).keys()
    return {name: buf for name, buf in model.named_buffers() if name in persistent}
