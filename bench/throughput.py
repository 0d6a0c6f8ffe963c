"""Training throughput with a checkpoint every ``--interval`` vs. none: the overhead should be < 0.5 %.

Each arm is the real ``job.app.train`` (build, CheckpointCadence, Checkpointer.save_async, the
background writer) with local checkpoints, no remote. A run is stopped after ``--duration`` seconds
of training by a StopRequest that also timestamps every step; steps/s is counted from the first
step to the stop (model building before, and the final durable save after, are not in the window).
The cadence clock starts before the window, so a 100 s window holds the checkpoints at 30, 60 and
90 s. The arms alternate ckpt, none / none, ckpt, ..., and the overhead is computed per round
(1 - ckpt/none) and reported as the median.

The stall of each checkpoint is read from the same timestamps: the step that took the checkpoint
and the one after it last longer than the median step by about the stall (save_async runs in
after_step; with the pipelined snapshot, the next step's optimizer update may wait for the copy). What remains
of the overhead is the background write competing with training for the CPUs.

The in-run measure (the steps a checkpoint touched against the median of the steps just before it)
is also taken in the run without checkpoints, at the same seconds into the run and over windows as
long: what it finds there is the estimator's own bias (step times are right-skewed), which grows with
the length of the background write, and is reported beside it and subtracted.
"""
from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/throughput.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (add_threads_option, apply_threads, interleaved, listening, median, parser, print_machine,
                          progress, ratio, scratch)
from bench.models import FOREVER, SIZES, bench_config
from job.signals import StopRequest

OVERHEAD_TARGET_PERCENT = 0.5  # issue 19 (issue 5 asked for 1 %)


class WindowStop(StopRequest):
    """A stop request that fires ``duration`` seconds after the first step, timing every step.

    The loop may ask it more than once per step (job.app's after_step asks before taking a due
    checkpoint, the loop asks again after after_step); the last call of a step wins, so the gap
    between two marks is one step including any save_async it did. CPU time (all threads of this process: the
    training and the background writer) is recorded too: unlike wall time, it hardly moves when
    other processes take the cores (with one torch thread; OpenMP spin-waits inflate it otherwise).
    """

    def __init__(self, duration: float) -> None:
        super().__init__(grace_period=float("inf"))
        self.duration = duration
        self.marks: list[tuple[int, float, float]] = []  # (step, perf_counter, process CPU s) after each step

    def should_stop(self, state: object = None) -> bool:
        if self.requested or state is None:
            return self.requested
        step, now = state.timer.batch.value, time.perf_counter()  # type: ignore[attr-defined]
        if self.marks and self.marks[-1][0] == step:
            self.marks[-1] = (step, now, time.process_time())
        else:
            self.marks.append((step, now, time.process_time()))
        if now - self.marks[0][1] >= self.duration:
            self.request("benchmark window over")
        return self.requested


class CheckpointEvents(logging.Handler):
    """Collects the ``checkpoint`` events of background writes (step, bytes, write seconds); the final
    durable save after the stop is written by the training thread and left out."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.events: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "event", None) == "checkpoint" and record.threadName.startswith("checkpoint-"):
            self.events.append(dict(getattr(record, "fields", {})))


@dataclass
class Arm:
    steps_per_s: float
    cpu_per_step: float
    steps: int
    checkpoints: int = 0
    stalls: list[float] = field(default_factory=list)  # extra time of the step that took one and the next
    writes: list[float] = field(default_factory=list)  # background write seconds
    windows: list[tuple[float, float]] = field(default_factory=list)  # (seconds into the run, write s) per checkpoint
    durations: dict[int, float] = field(default_factory=dict)  # step -> its wall time
    ends: dict[int, float] = field(default_factory=dict)  # step -> seconds into the run when it ended

    @property
    def excess(self) -> float:
        """Extra seconds of the steps during this run's checkpoints, vs. the steps just before each."""
        return self.control(self.windows)

    def control(self, windows: list[tuple[float, float]]) -> float:
        """What :func:`_excess` finds in this run at another run's checkpoint windows. Run on the arm with
        no checkpoints it measures the estimator itself: step times are skewed (a few slow steps, many
        near the median), so a sum of differences from a median over a window grows with the window's
        length even when nothing happens in it; a slower background write has a longer window."""
        total = 0.0
        for at, write in windows:
            step = next((s for s, end in self.ends.items() if end >= at), None)
            if step is not None:
                total += _excess(self.durations, self.ends, step, write)
        return total

    def __str__(self) -> str:
        return (f"{self.steps_per_s:.3f} steps/s, {self.cpu_per_step * 1e3:.1f} CPU-ms/step over {self.steps} steps, "
                f"{self.checkpoints} checkpoints"
                + (f" (step stall {median(self.stalls) * 1e3:.0f} ms, write {median(self.writes):.2f} s, "
                   f"excess {self.excess:.2f} s)" if self.stalls else ""))


def run_arm(cfg: Any, interval: str, duration: float, folder: Path) -> Arm:
    from job.app import train
    from tests.support.jobs import ckpt_config

    stop = WindowStop(duration)
    handler = CheckpointEvents()
    with listening("job.checkpoint", handler):
        train(cfg, ckpt_config(folder, interval=interval, keep=1, resume="never"), stop=stop)
    marks = stop.marks
    (first, t0, c0), (last, t1, c1) = marks[0], marks[-1]
    ends = {step: t - t0 for step, t, _ in marks}  # seconds into the run
    durations = {step: b - a for (_, a, _), (step, b, _) in zip(marks, marks[1:])}
    typical = median(list(durations.values()))
    inside = [e for e in handler.events if first < e["step"] <= last and e["step"] in durations]
    return Arm(
        steps_per_s=(last - first) / (t1 - t0), cpu_per_step=(c1 - c0) / (last - first), steps=last - first,
        checkpoints=len(inside),
        stalls=[sum(durations.get(s, typical) - typical for s in (e["step"], e["step"] + 1)) for e in inside],
        writes=[float(e["seconds"]) for e in inside],
        windows=[(ends[e["step"]], float(e["seconds"])) for e in inside], durations=durations, ends=ends,
    )


def _excess(durations: dict[int, float], ends: dict[int, float], step: int, write: float, before: int = 20) -> float:
    """Extra time of the steps a checkpoint touched (the one that took it and those that ran during its
    background write) over the median of the ``before`` steps just before it: a local comparison,
    immune to load changes slower than a few seconds."""
    reference = [durations[s] for s in range(step - before, step) if s in durations]
    if not reference:
        return 0.0
    ref = median(reference)
    touched = [s for s in durations if s >= step and ends[s] <= ends[step] + write + ref]
    return sum(durations[s] - ref for s in touched)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--model", default="100MB", help=f"a size ({', '.join(SIZES)}) or a --model spec")
    p.add_argument("--interval", default="30s", help="checkpoint interval of the checkpointing arm")
    p.add_argument("--duration", default="100s", help="training seconds per run (each arm runs once per round)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--precision", default="fp32")
    p.add_argument("--batch-size", type=int, default=64)
    add_threads_option(p)
    args = p.parse_args(argv)
    apply_threads(args.threads)
    if args.smoke:
        args.model, args.interval, args.duration = "smoke", "1s", "3s"
    rounds = args.rounds or (1 if args.smoke else 2)
    duration = float(args.duration.rstrip("s"))
    cfg = bench_config(args.model, device=args.device, precision=args.precision, batch_size=args.batch_size)
    print_machine(args.tmpdir)
    progress(f"model {cfg.model}, checkpoint every {args.interval} vs none, {duration:g} s per run, {rounds} round(s)")
    with scratch("throughput", args.tmpdir) as workdir:
        counter = iter(range(10 ** 6))
        results = interleaved(
            {"ckpt": lambda: run_arm(cfg, args.interval, duration, workdir / f"run-{next(counter)}"),
             "none": lambda: run_arm(cfg, FOREVER, duration, workdir / f"run-{next(counter)}")},
            rounds=rounds, log=progress)
    ckpt, none = results["ckpt"], results["none"]
    wall = [100.0 * (1 - c.steps_per_s / n.steps_per_s) for c, n in zip(ckpt, none)]
    cpu = [100.0 * (c.cpu_per_step / n.cpu_per_step - 1) for c, n in zip(ckpt, none)]
    in_run = [100.0 * c.excess * c.steps_per_s / c.steps for c in ckpt]  # excess / window seconds
    control = [100.0 * n.control(c.windows) * c.steps_per_s / c.steps for c, n in zip(ckpt, none)]
    net = [r - k for r, k in zip(in_run, control)]
    stalls = [s for arm in ckpt for s in arm.stalls]
    writes = [w for arm in ckpt for w in arm.writes]
    print(f"model {cfg.model}, batch {cfg.batch_size}, checkpoint every {args.interval}, {duration:g} s per run, "
          f"{rounds} round(s)")
    for name, arms in (("none", none), ("ckpt", ckpt)):
        print(f"{name}: steps/s " + ", ".join(f"{a.steps_per_s:.3f}" for a in arms)
              + f" (median {median([a.steps_per_s for a in arms]):.3f}); CPU-ms/step "
              + ", ".join(f"{a.cpu_per_step * 1e3:.1f}" for a in arms)
              + (f"; {sum(a.checkpoints for a in arms)} checkpoints in the windows" if name == "ckpt" else ""))
    if stalls:
        print(f"per checkpoint: loop stall (extra time of the step that took it and the next) "
              f"median {median(stalls) * 1e3:.0f} ms, "
              f"background write median {median(writes):.2f} s")
    print("overhead per round: steps/s " + ", ".join(f"{o:+.2f} %" for o in wall) + "; CPU per step "
          + ", ".join(f"{o:+.2f} %" for o in cpu) + "; in-run (steps around checkpoints vs. just before) "
          + ", ".join(f"{o:+.2f} %" for o in in_run) + "; the same measure in the run without checkpoints, at "
          "the same times (the estimator's own bias) " + ", ".join(f"{o:+.2f} %" for o in control)
          + "; in-run less that " + ", ".join(f"{o:+.2f} %" for o in net))
    print(ratio("overhead % (1 - ckpt/none steps/s, median of rounds)", median(wall), OVERHEAD_TARGET_PERCENT)
          + f"; CPU per step {median(cpu):+.2f} %; in-run {median(in_run):+.2f} %, less its bias "
          f"{median(net):+.2f} %", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
