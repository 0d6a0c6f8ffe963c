"""What a checkpoint costs the steps around it: the pipelined snapshot vs. copying everything at once.

Issue 19: the parameters and optimizer state are copied while the next step runs its forward and
backward (job.snapshot, Checkpointer.before_update). The in-run measure is the loop's own: per-step
wall time. Arms, interleaved in one process on the same State (params + AdamW moments, after real
steps), each round timing one plain step, then ``save_async`` plus the next step together:

* ``pipelined``: the job as it is.
* ``at_once``: the same Checkpointer with nothing left for later (every tensor copied inside
  ``save_async``, as before the pipelining).
* ``sync``: ``torch.save(state.state_dict())`` + fsync, the synchronous save the target is relative to.
* ``copy_only``: no checkpoint: a thread (at the writer's priority, alone as the writer copies) copies
  every tensor of the state once into reused buffers while the next step runs. The floor of any design
  that copies the state while training goes on: on a CPU the copy and the step share the memory bus,
  however many cores there are, so this is what "the copy overlaps the step" costs here.

The writes are waited for, untimed, between steps, so no arm measures another's disk traffic.
Reported per arm: the extra time of "save_async + next step" over the plain step, and the loop stall
(``last_stall_seconds``, the copy plus any wait in ``before_update``). Target: the pipelined extra
time <= 0.05x the synchronous save, whenever one forward+backward takes at least as long as the copy.
Single steps vary by tens of ms on a shared VM: use many rounds (medians of paired differences).

Every arm starts after ``--settle`` seconds of quiet (bench.common.interleaved): without them a step
that runs while the gigabyte the previous arm just freed (its old checkpoint pruned, the sync arm's
file deleted) is handed back to the VM's host pays the previous arm's cost; a real run's checkpoints
are minutes apart. An arm's own prune, right after its commit, still lands in its own rounds.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as `python bench/pipelined_step.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (add_settle_option, add_threads_option, apply_threads, human_bytes, interleaved, median,
                          parser, print_machine, progress, ratio, scratch, settle_seconds)
from bench.models import SIZES, bench_config, chosen_sizes, nbytes, prepared_run, sync_save_seconds, tensors_of

TARGET = 0.05


def measure(size: str, rounds: int, warmup: int, workdir: Path, settle: float) -> dict[str, float]:
    import job.checkpoint as checkpoint
    import job.snapshot as snapshot
    from job.checkpoint import Checkpointer
    from job.loop import Trainer, to_device

    cfg = bench_config(size)
    run = prepared_run(cfg, steps=2)
    state = run.state
    size_bytes = nbytes(tensors_of(state.state_dict()))
    progress(f"{size}: {human_bytes(size_bytes)} of state")
    pipelined_rule = checkpoint.written_by_update
    nothing_later = lambda optimizers: (lambda path, tensor: False)  # noqa: E731

    def batches() -> Any:
        while True:
            yield from state.train_dataloader

    stream = batches()
    sync_path = workdir / "sync.pt"

    def arm(name: str, rule: Any) -> Any:
        ckpt = Checkpointer(workdir / name, keep=1, meta={})
        ckpt.reserve(state)
        ckpt.wait()
        trainer = Trainer(run, cfg.eval_interval, cfg.log_interval, after_step=lambda s, e: None,
                          before_update=ckpt.before_update)

        def one_round() -> dict[str, float]:
            checkpoint.written_by_update = rule
            try:
                ckpt.wait()
                started = time.perf_counter()
                trainer.train_step(to_device(next(stream), run.device))
                plain = time.perf_counter()
                if not ckpt.save_async(state):
                    raise RuntimeError("save_async deferred although nothing was in flight")
                trainer.train_step(to_device(next(stream), run.device))
                done = time.perf_counter()
                ckpt.wait()  # untimed: the next arm must not compete with this write
            finally:
                checkpoint.written_by_update = pipelined_rule
            return {"plain": plain - started, "around": done - plain, "stall": ckpt.last_stall_seconds or 0.0}

        return one_round

    def sync() -> dict[str, float]:
        return {"sync": sync_save_seconds(state, sync_path)}

    sources = tensors_of(state.state_dict())
    copies = [torch.empty_like(t) for t in sources]
    plain_trainer = Trainer(run, cfg.eval_interval, cfg.log_interval, after_step=lambda s, e: None)

    def copy_only() -> dict[str, float]:
        def copy_all() -> None:
            checkpoint._yield_cpu_to_training()
            for buf, src in zip(copies, sources):
                snapshot.copy_into(buf, src, alone=True)

        started = time.perf_counter()
        plain_trainer.train_step(to_device(next(stream), run.device))
        plain = time.perf_counter()
        copier = threading.Thread(target=copy_all, name="bench-copy")
        copier.start()
        plain_trainer.train_step(to_device(next(stream), run.device))
        done = time.perf_counter()
        copier.join()
        return {"plain": plain - started, "around": done - plain, "stall": 0.0}

    arms = {"pipelined": arm("pipelined", pipelined_rule), "at_once": arm("at_once", nothing_later), "sync": sync,
            "copy_only": copy_only}
    results = interleaved(arms, rounds=rounds, warmup=warmup, log=progress, settle=settle)
    out = {"sync": median([r["sync"] for r in results["sync"]]), "bytes": float(size_bytes)}
    for name in ("pipelined", "at_once", "copy_only"):
        runs = results[name]
        out[f"{name}_extra"] = median([r["around"] - r["plain"] for r in runs])
        out[f"{name}_stall"] = median([r["stall"] for r in runs])
        out[f"{name}_step"] = median([r["plain"] for r in runs])
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--sizes", default="600MB,1GB", help=f"comma-separated, of: {', '.join(SIZES)}")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    add_settle_option(p)
    add_threads_option(p)
    args = p.parse_args(argv)
    apply_threads(args.threads)
    sizes = chosen_sizes(args.sizes, args.smoke)
    rounds = args.rounds or (1 if args.smoke else 15)
    warmup = 0 if args.smoke else args.warmup
    print_machine(args.tmpdir)
    verdicts = []
    with scratch("pipelined", args.tmpdir) as workdir:
        for size in sizes:
            m = measure(size, rounds, warmup, workdir, settle_seconds(args))
            print(f"{size} ({human_bytes(m['bytes'])}), median of {rounds}: plain step {m['pipelined_step']:.3f} s; "
                  f"extra time of save_async + next step: pipelined {m['pipelined_extra'] * 1e3:+.1f} ms "
                  f"(stall {m['pipelined_stall'] * 1e3:.1f} ms), at once {m['at_once_extra'] * 1e3:+.1f} ms "
                  f"(stall {m['at_once_stall'] * 1e3:.1f} ms); a bare copy of the state alongside the step (the floor) "
                  f"{m['copy_only_extra'] * 1e3:+.1f} ms; synchronous torch.save {m['sync']:.3f} s; floor/sync save "
                  f"{m['copy_only_extra'] / m['sync']:.3f}", flush=True)
            verdicts.append(ratio(f"{size} pipelined extra/sync save", m["pipelined_extra"] / m["sync"], TARGET))
    print("; ".join(verdicts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
