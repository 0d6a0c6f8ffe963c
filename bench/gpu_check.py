"""The GPU check, prepared for a machine with a CUDA GPU (none was lent when the benchmarks were written).

What it measures, with the largest built-in model (mlp-large, ~100M parameters, 1.2 GB of fp32 state
with AdamW) trained in bf16 autocast:

1. ``bench.checkpoint_stall --device cuda``: the loop's stall per checkpoint (save_async returning)
   vs. a bare non-blocking copy into pinned buffers, and the device-to-host copy's GB/s (time until
   the copy has really finished, i.e. after synchronize).
2. ``bench.throughput --device cuda``: steps/s with a checkpoint every few seconds vs. none, and the
   per-checkpoint stall seen by the loop (the extra time of the step that took it).
3. The real CLI: ``job train --device cuda --precision amp_bf16 --model mlp-large --save-interval 5s``,
   reporting its checkpoint events (count, bytes, background write seconds and GB/s) and samples/s.

Run from the repository root, in a venv with a CUDA build of torch (``make test TORCH='torch==2.13.0
--index-url https://download.pytorch.org/whl/cu128'`` installs one)::

    python bench/gpu_check.py            # about 5 minutes on one GPU
    python bench/gpu_check.py --dry-run  # print the commands only

``--device cpu --precision fp32 --model mlp --sizes smoke ...`` rehearses the same steps on a CPU.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(argv: list[str], dry_run: bool, timeout: float) -> str:
    """Run one step with its output shown live; returns its stdout."""
    print("$ " + shlex.join(argv), flush=True)
    if dry_run:
        return ""
    done = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, text=True, timeout=timeout)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        raise SystemExit(f"gpu_check: step failed with exit code {done.returncode}: {shlex.join(argv)}")
    return done.stdout


def job_train_summary(stderr: str) -> str:
    """Checkpoint count, bytes, background write time and GB/s, and the median samples/s, from the JSON log."""
    events = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
    ckpts = [e for e in events if e.get("event") == "checkpoint"]
    speeds = [e["samples_per_sec"] for e in events if e.get("event") == "progress"]
    if not ckpts:
        return "job train: no checkpoint event (run longer: --max-duration)"
    writes = [float(e["seconds"]) for e in ckpts]
    size = ckpts[-1]["bytes"]
    return (f"job train: {len(ckpts)} checkpoints of {size / 1e9:.2f} GB, background write median "
            f"{statistics.median(writes):.2f} s = {size / statistics.median(writes) / 1e9:.2f} GB/s, "
            f"median {statistics.median(speeds) if speeds else float('nan'):.0f} samples/s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--precision", default="amp_bf16")
    p.add_argument("--model", default="mlp-large", help="for throughput and job train")
    p.add_argument("--sizes", default="1GB,mlp-large", help="for checkpoint_stall")
    p.add_argument("--save-interval", default="5s")
    p.add_argument("--duration", default="30s", help="per throughput run")
    p.add_argument("--max-duration", default="3000ba", help="of the job train run")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = p.parse_args(argv)
    py = sys.executable
    if not args.dry_run:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device visible (torch.cuda.is_available() is False)")
        name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        print(f"device: {name}; torch {torch.__version__}; date {time.strftime('%Y-%m-%dT%H:%M:%S%z')}", flush=True)
    stall = run([py, "-m", "bench.checkpoint_stall", "--device", args.device, "--precision", args.precision,
                 "--sizes", args.sizes], args.dry_run, timeout=900)
    throughput = run([py, "-m", "bench.throughput", "--device", args.device, "--precision", args.precision,
                      "--model", args.model, "--interval", args.save_interval, "--duration", args.duration,
                      "--batch-size", str(args.batch_size)], args.dry_run, timeout=900)
    with tempfile.TemporaryDirectory(prefix="bench-gpu-", dir="/tmp") as tmp:
        argv_job = [py, "-m", "job", "train", "--device", args.device, "--precision", args.precision,
                    "--model", args.model, "--save-interval", args.save_interval, "--max-duration",
                    args.max_duration, "--batch-size", str(args.batch_size), "--eval-interval", "1000000ba",
                    "--log-interval", "50", "--log-format", "json", "--keep", "1", "--save-folder", tmp]
        print("$ " + shlex.join(argv_job), flush=True)
        summary = "job train: (dry run)"
        if not args.dry_run:
            done = subprocess.run(argv_job, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                  timeout=900)
            if done.returncode != 0:
                raise SystemExit(f"gpu_check: job train failed ({done.returncode}):\n{done.stderr[-2000:]}")
            summary = job_train_summary(done.stderr)
    print(summary)
    for text in (throughput, stall):  # the stall ratio line last
        lines = text.strip().splitlines()
        if lines:
            print(lines[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
