"""Run under torchrun on 3 ranks (tests/job/test_ddp_buckets.py): job.ddp_buckets.settle on a model whose forward
registers a buffer at its first call, draws dropout and updates batch-norm statistics. Each rank checks that the
warm-up left nothing behind, and rank 0 prints "ok" once every rank has."""
from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from job import ddp_buckets


class RegistersInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm, self.drop = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5)
        self.saw_warm_up: list[bool] = []

    def forward(self, batch: Any) -> torch.Tensor:
        self.saw_warm_up.append(ddp_buckets.warming_up())
        if not hasattr(self, "scale"):  # registered at the first call: it comes first in buffers()
            self.register_buffer("scale", torch.full((4,), 2.0))
        return self.drop(self.norm(self.lin(batch[0]))) * self.scale

    def loss(self, outputs: torch.Tensor, batch: Any) -> torch.Tensor:
        return outputs.pow(2).mean()


def main() -> int:
    dist.init_process_group("gloo")
    torch.manual_seed(dist.get_rank())
    core = RegistersInForward()
    model = DistributedDataParallel(core)
    model.train()
    micro = (torch.randn(8, 4),)
    stats = {name: b.clone() for name, b in core.named_buffers()}
    rng = torch.get_rng_state()
    state = SimpleNamespace(precision_context=contextlib.nullcontext(), batch=None)
    ddp_buckets.settle(model, state, micro, dist.get_world_size())  # type: ignore[arg-type]
    problems = [f"{name} changed" for name, before in stats.items()
                if not torch.equal(dict(core.named_buffers())[name], before)]
    problems += [] if torch.equal(torch.get_rng_state(), rng) else ["the torch generator moved"]
    problems += [f"{name} kept a gradient" for name, p in core.named_parameters() if p.grad is not None]
    problems += [] if core.saw_warm_up == [True] and not ddp_buckets.warming_up() else ["warming_up() was wrong"]
    model(micro).sum().backward()  # a real step after it: DDP's buckets must be usable
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    if dist.get_rank() == 0:
        print("ok" if not any(everyone) else f"problems: {everyone}", flush=True)
    dist.destroy_process_group()
    return 0 if not any(everyone) else 1


if __name__ == "__main__":
    sys.exit(main())
