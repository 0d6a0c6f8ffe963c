"""Asynchronous sharded checkpoints driven step by step, as job.app's loop drives them (under torchrun,
CPU, gloo): ``python -m tests.support.sharded_async_steps OUT``.

An FSDP2 state of the built-in MLP takes two optimizer steps; ``save_async`` takes a sharded checkpoint
of step 2 into ``OUT/ck``; the state takes two more steps, with ``Checkpointer.poll()`` after each (the
write goes on meanwhile), and polls until the checkpoint is committed. Then ``save_async`` at step 4
and ``wait``. Rank 0 writes what torch itself gathers of the state at steps 2 and 4 to
``OUT/expected-<step>.pt`` (taken right after each save_async, before the next step), and logs one JSON
line ``{"event": "async_steps", "buffers_reused": ..., "in_flight_after_save": ...}`` to stderr.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from job import distributed
from job.checkpoint import Checkpointer
from tests.support.sharded_twins import gathered, sharded_state, train_step


def buffers(ckpt: Checkpointer) -> list[int]:
    staged = ckpt._host_shards._buffers or {}
    return [t.to_local().data_ptr() for t in staged["model"].values()]


def run(out: Path) -> int:
    state = sharded_state()
    meta = {"model": "mlp", "data": "spirals", "seed": 11, "world_size": distributed.world_size(),
            "batch_size": 32, "grad_accum": 1}
    ckpt = Checkpointer(out / "ck", keep=5, meta=meta, sharded=True)

    def save_async() -> bool:
        assert ckpt.save_async(state)
        in_flight = ckpt.in_flight()
        model, optim = gathered(state)  # collective: every rank
        if distributed.rank() == 0:
            torch.save({"model": model, "optim": optim}, out / f"expected-{state.timer.batch.value}.pt")
        return in_flight

    for step in range(2):
        train_step(state, step)
    flight = [save_async()]
    first = buffers(ckpt)
    for step in range(2, 4):  # training goes on while the checkpoint of step 2 is written
        train_step(state, step)
        ckpt.poll()
    while ckpt.in_flight():
        ckpt.poll()
        time.sleep(0.01)
    flight.append(save_async())
    ckpt.wait()
    if distributed.rank() == 0:
        print(json.dumps({"event": "async_steps", "buffers_reused": buffers(ckpt) == first,
                          "in_flight_after_save": flight}), file=sys.stderr, flush=True)
    distributed.barrier()
    return 0


def main() -> None:
    dist.init_process_group("gloo")
    code = run(Path(sys.argv[1]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # never through gloo's destructors (job.distributed.joined)


if __name__ == "__main__":
    main()
