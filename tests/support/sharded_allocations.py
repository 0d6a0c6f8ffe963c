"""Under torchrun (CPU, gloo): the largest tensor storage that ``job.build`` allocates off the meta device
while it builds a ``--sharded`` model, seen by a dispatch mode. Each rank writes ``OUT/rank-R.json``:
``{"largest": elements of the largest storage, "parameter": elements of the largest parameter, whole}``.

``python -m tests.support.sharded_allocations MODEL OUT``, MODEL ``wide`` (opts in to the deferred build)
or ``wide_plain`` (does not).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from job import distributed
from job.build import build
from job.builtin import MLP
from job.cli import torchrun_env
from job.deferred_init import skip_init_on_resume
from tests.support.jobs import train_config

WIDTH = 1024  # a 1M-element layer: far larger than anything else a build allocates (the spirals: 6K)


@skip_init_on_resume
def wide() -> nn.Module:
    return MLP(hidden=WIDTH)


def wide_plain() -> nn.Module:
    return MLP(hidden=WIDTH)


class Largest(TorchDispatchMode):
    """The largest storage behind any tensor an operation returns, a DTensor's local one included."""

    def __init__(self) -> None:
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, DTensor):
                t = t._local_tensor
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self.elements = max(self.elements, t.untyped_storage().nbytes() // t.element_size())
        return out


def main(model: str, out: str) -> None:
    distributed.init(torchrun_env(), "cpu")
    with Largest() as seen:
        run = build(train_config(model=f"{__name__}:{model}", sharded=True), defer_init=True)  # as job.app does
    whole = max(p.numel() for p in run.state.model.parameters())  # a DTensor's numel is its whole tensor's
    result = {"largest": seen.elements, "parameter": whole, "deferred": run.pending_init is not None}
    (Path(out) / f"rank-{distributed.rank()}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # never through gloo's destructors (job.distributed.joined): they abort or hang at exit
