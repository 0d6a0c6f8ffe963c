"""Training-loop stall per checkpoint: Checkpointer.save_async vs. a bare copy vs. a synchronous save.

The loop is blocked only while save_async copies the state into reused host buffers; serializing,
hashing, fsync and commit run in a background thread. So the stall should cost about what copying
the same tensors costs with no bookkeeping at all (target: <= 1.2x), and far less than the naive
``torch.save(state_dict, path)`` + fsync a loop would otherwise block on (target: <= 0.2x).

Arms, interleaved in one process on the same State (params + AdamW moments, after real steps):

* ``stall``: the time ``Checkpointer.save_async(state)`` and ``before_update()`` right after it take
  to return: the worst case, with no forward and backward for the background copy of the parameters
  and optimizer state to overlap with (in the loop they run between the two). Before it, the previous
  background write has finished, and after it this one is waited for (untimed), so every
  repetition measures the copy, never a deferral ("still writing, skipped") or disk contention.
* ``copy``: the fair baseline, the same work without our bookkeeping: ``copy_`` of every tensor of
  the same state dict into buffers preallocated once (pinned on CUDA, non-blocking), as the snapshot
  does, but without calling state_dict() or walking the tree.
* ``sync``: ``torch.save(state.state_dict(), path)`` + flush + fsync on the same disk.
* ``fresh`` (information only): a copy into newly allocated host memory every time
  (``t.to("cpu", copy=True)``), i.e. what a snapshot without reused buffers would pay.

On CUDA the copies are asynchronous: ``stall`` and ``copy`` are the time until the call returns, and
``*_done`` the time until the device-to-host copy has finished (synchronize), whose GB/s is printed.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as `python bench/checkpoint_stall.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import (add_threads_option, apply_threads, human_bytes, interleaved, median, parser, print_machine,
                          progress, ratio, scratch)
from bench.models import SIZES, bench_config, chosen_sizes, nbytes, prepared_run, sync_save_seconds, tensors_of

STALL_VS_COPY = 1.2
STALL_VS_SYNC = 0.2


def measure(size: str, device: str, precision: str, rounds: int, warmup: int, workdir: Path) -> dict[str, float]:
    """Medians (seconds) of every arm for one state size; ``first_stall`` is the warm-up's (buffer allocation),
    ``first_stall_reserved`` the first one of a Checkpointer that reserved its buffers first, as the job's does."""
    from job.app import run_meta
    from job.checkpoint import Checkpointer

    cfg = bench_config(size, device=device, precision=precision)
    run = prepared_run(cfg)
    state = run.state
    cuda = run.device.type == "cuda"
    sources = tensors_of(state.state_dict())
    size_bytes = nbytes(sources)
    progress(f"{size}: {len(sources)} tensors, {human_bytes(size_bytes)} of state on {run.device}")

    checkpointer = Checkpointer(workdir / "ckpt", keep=1, meta=run_meta(cfg), pin_memory=cuda)
    buffers = [torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=cuda) for t in sources]
    sync_path = workdir / "sync.pt"

    def sync_device() -> None:
        if cuda:
            torch.cuda.synchronize()

    def stall() -> dict[str, float]:
        checkpointer.wait()  # the previous write is done: this measures the copy, not a deferral
        sync_device()
        started = time.perf_counter()
        if not checkpointer.save_async(state):
            raise RuntimeError("save_async deferred although nothing was in flight")
        checkpointer.before_update()  # the optimizer step at once: waits for the copy of the parameters
        returned = time.perf_counter()
        sync_device()
        done = time.perf_counter()
        checkpointer.wait()  # untimed: the next arm must not compete with this write
        return {"stall": returned - started, "stall_done": done - started}

    def copy() -> dict[str, float]:
        sync_device()
        started = time.perf_counter()
        for dst, src in zip(buffers, sources):
            dst.copy_(src, non_blocking=cuda)
        returned = time.perf_counter()
        sync_device()
        return {"copy": returned - started, "copy_done": time.perf_counter() - started}

    def fresh() -> dict[str, float]:
        sync_device()
        started = time.perf_counter()
        copies = [t.detach().to("cpu", copy=True) for t in sources]
        elapsed = time.perf_counter() - started
        del copies
        return {"fresh": elapsed}

    def sync() -> dict[str, float]:
        sync_device()
        return {"sync": sync_save_seconds(state, sync_path)}

    arms = {"stall": stall, "copy": copy, "fresh": fresh, "sync": sync}
    first = stall()  # allocates the snapshot buffers: reported, not part of the medians
    # What the job does instead: reserve the buffers in the background at start-up (Checkpointer.reserve).
    reserved = Checkpointer(workdir / "ckpt-reserved", keep=1, meta=run_meta(cfg), pin_memory=cuda)
    reserved.reserve(state)
    reserved.wait()
    started = time.perf_counter()
    reserved.save_async(state)
    first_reserved = time.perf_counter() - started
    reserved.wait()
    del reserved
    results = interleaved(arms, rounds=rounds, warmup=warmup, log=progress)
    checkpointer.wait()
    out = {key: median([r[key] for r in runs]) for runs in results.values() for key in runs[0]}
    out["first_stall"] = first["stall"]
    out["first_stall_reserved"] = first_reserved
    out["bytes"] = float(size_bytes)
    del checkpointer, buffers, run, state, sources
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--sizes", default="100MB,1GB", help=f"comma-separated, of: {', '.join(SIZES)}")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32", help="fp32, or amp_bf16/amp_fp16 with --device cuda")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured rounds first")
    add_threads_option(p)
    args = p.parse_args(argv)
    apply_threads(args.threads)
    sizes = chosen_sizes(args.sizes, args.smoke)
    rounds = args.rounds or (1 if args.smoke else 5)
    warmup = 0 if args.smoke else args.warmup
    print_machine(args.tmpdir)
    table = {}
    with scratch("stall", args.tmpdir) as workdir:
        for size in sizes:
            r = measure(size, args.device, args.precision, rounds, warmup, workdir / size)
            table[size] = r
            line = (f"{size}: state {human_bytes(r['bytes'])}, median of {rounds}: stall {r['stall'] * 1e3:.1f} ms, "
                    f"copy {r['copy'] * 1e3:.1f} ms, fresh-alloc copy {r['fresh'] * 1e3:.1f} ms, "
                    f"sync save {r['sync'] * 1e3:.0f} ms; first stall (allocating buffers) "
                    f"{r['first_stall'] * 1e3:.1f} ms, {r['first_stall_reserved'] * 1e3:.1f} ms after reserve()")
            if args.device == "cuda":
                line += (f"; D2H done: snapshot {r['stall_done'] * 1e3:.1f} ms = "
                         f"{r['bytes'] / r['stall_done'] / 1e9:.1f} GB/s, bare copy {r['copy_done'] * 1e3:.1f} ms = "
                         f"{r['bytes'] / r['copy_done'] / 1e9:.1f} GB/s")
            print(line, flush=True)
            print(f"  {size}: " + ratio("stall/copy", r["stall"] / r["copy"], STALL_VS_COPY) + "; "
                  + ratio("stall/sync", r["stall"] / r["sync"], STALL_VS_SYNC), flush=True)
    worst_copy = max(r["stall"] / r["copy"] for r in table.values())
    worst_sync = max(r["stall"] / r["sync"] for r in table.values())
    per_size = ", ".join(f"{s} {r['stall'] / r['copy']:.2f}/{r['stall'] / r['sync']:.3f}" for s, r in table.items())
    print(ratio("stall/copy", worst_copy, STALL_VS_COPY) + "; " + ratio("stall/sync", worst_sync, STALL_VS_SYNC)
          + f" [worst of sizes; per size copy/sync: {per_size}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
