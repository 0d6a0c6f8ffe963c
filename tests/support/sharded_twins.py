"""Sharded checkpoints of known weights, for tests of resharding (run under torchrun, CPU, gloo).

``save OUT [STEPS]``: an FSDP2 state of the built-in MLP takes two (or STEPS) optimizer steps on W ranks and is saved by
the job's Checkpointer as a sharded checkpoint in ``OUT/w<W>``. Rank 0 also writes what torch itself
gathers of it (get_model_state_dict / get_optimizer_state_dict with full_state_dict, not this
project's DCP code) to ``OUT/reference.pt``, and the same weights as an unsharded checkpoint in
``OUT/full``.

``check SRC OUT NAME``: a fresh FSDP2 state on W' ranks loads checkpoint SRC (sharded or not) with the
job's own load_shard, and rank 0 compares what torch gathers of its model and optimizer with
``OUT/reference.pt``, exactly; then the state is saved sharded again in ``OUT/NAME``. Rank 0 logs one
JSON line ``{"event": "compared", "equal": ..., "differs": [...]}`` to stderr; exits 0 when equal.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from job import distributed, elastic
from job.build import build
from job.checkpoint import Checkpointer, load_shard
from job.restore import restore
from job.sharded import by_id
from tests.support.jobs import train_config
from uploader.manifest import Manifest

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def sharded_state() -> Any:
    return build(train_config(sharded=True, batch_size=32, grad_accum=1, seed=11)).state


def gathered(state: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full model and optimizer state, as torch gathers them (rank 0; empty elsewhere)."""
    opt = state.optimizers[0]
    return get_model_state_dict(state.model, options=FULL), get_optimizer_state_dict(state.model, opt, options=FULL)


def train_step(state: Any, step: int) -> None:
    """One optimizer step on the ``step``-th 32 samples of the data, every rank the same batch."""
    data = state.train_dataloader.dataset
    batch = [t for t in data[step * 32:(step + 1) * 32]]
    loss = state.model.loss(state.model(batch), batch)
    loss.backward()
    state.optimizers[0].step()
    state.optimizers[0].zero_grad()
    state.timer.on_batch_complete(samples=32)


def save(out: Path, steps: int = 2) -> int:
    state = sharded_state()
    for step in range(steps):
        train_step(state, step)
    world = distributed.world_size()
    meta = {"model": "mlp", "data": "spirals", "seed": 11, "world_size": world, "batch_size": 32, "grad_accum": 1}
    Checkpointer(out / f"w{world}", keep=3, meta=meta, sharded=True).save(state)
    model, optim = gathered(state)
    if distributed.rank() == 0:
        torch.save({"model": model, "optim": optim}, out / "reference.pt")
        tree = state.state_dict()
        tree.update(model=model, optimizers={"AdamW": by_id(optim)})
        full = Checkpointer(out / "full", keep=3, meta={**meta, "world_size": 1, "sharded": False})
        full._write(tree, state.timer.batch.value, state.timer.state_dict(), set(model))
    distributed.barrier()
    return 0


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}.{i}")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def check(src: Path, out: Path, name: str) -> int:
    state = sharded_state()
    manifest = Manifest.read(src)
    manifest.verify(src)
    tree = load_shard(src, manifest, state)
    handover = elastic.for_this_rank(tree, distributed.rank(), distributed.world_size(), seed=state.rank_zero_seed,
                                     step=manifest.step, source=str(src))
    restore(state, handover.tree, str(src), manifest.step, manifest.timer)
    model, optim = gathered(state)
    code = 0
    if distributed.rank() == 0:
        reference = torch.load(out / "reference.pt", weights_only=True)
        differs = differences(model, reference["model"], "model") + differences(optim, reference["optim"], "optim")
        print(json.dumps({"event": "compared", "equal": not differs, "differs": differs[:10],
                          "step": state.timer.batch.value}), file=sys.stderr, flush=True)
        code = 0 if not differs else 1
    world = distributed.world_size()
    Checkpointer(out / name, keep=3, meta={**manifest.meta, "world_size": world}, sharded=True).save(state)
    return code


def main() -> None:
    dist.init_process_group("gloo")
    mode, *args = sys.argv[1:]
    code = save(Path(args[0]), *map(int, args[1:])) if mode == "save" else check(Path(args[0]), Path(args[1]), args[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never through gloo's destructors (job.distributed.joined)


if __name__ == "__main__":
    main()
