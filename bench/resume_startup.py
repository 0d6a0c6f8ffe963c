"""Time from start-up to the first training step when resuming from the bucket, vs. download + torch.load.

A job on a new machine lists the bucket, pulls the newest complete checkpoint (sha256-checked while
it streams, committed; not fsynced, see uploader.sync "Pull"), loads it and starts training. The floor for that is
fetching the bytes and unpickling them: ``s5cmd cp`` of the state file plus
``torch.load(weights_only=True)``. Target: ours <= 1.2x that floor.

Arms, interleaved, every one from a fresh local folder against the same SeaweedFS bucket:

* ``inprocess`` (the headline, fairer): ``job.app.train`` called in this process, torch and boto3
  already imported, timed from the call to the moment the first step starts (the loop's first
  ``should_stop``), and to the end of that first step. Includes building the model, which a resume
  pays and the floor does not (without its random initialisation: job.deferred_init).
* ``initialised``: the same, with the model's random initialisation that job.deferred_init skips done
  as before it (job.app's ``expects_checkpoint`` answering no): what the skipping gains, in the same run.
* ``at_once`` and ``unchecked``: the same as ``inprocess``, with the resumed state's NaN check
  (job.resumed_check) waited for before the first step instead of beside it, and without it: what
  running it beside the first step's forward and backward saves, and what the check costs.
* ``process``: the real ``job train --remote s3://... --max-duration <step+2>ba`` as a subprocess,
  timed from just before spawning it to the ``start`` event (training begins) and to the first
  ``progress`` event (first step done), from the JSON log's ``ts``. This includes process start-up.
* ``startup``: ``python -c "import job.cli, job.app, uploader.s3"`` alone: interpreter + torch +
  boto3 imports, what the process arm pays before doing any work, reported separately.
* ``floor``: ``s5cmd cp`` of the state file, then ``torch.load`` of it.

The checkpoint is made once at the start by a short real training run that uploads it.
"""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock
from typing import Any

if __package__ in (None, ""):  # run as `python bench/resume_startup.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (REPO, add_threads_option, apply_threads, human_bytes, interleaved, listening, median, parser,
                          print_machine, progress, ratio, s3_bucket, scratch, venv_binary)
from bench.models import FOREVER, SIZES, bench_config
from job.signals import StopRequest

TARGET = 1.2
SEED_STEPS = 2
STATE_FILE = "state.pt"


class FirstSteps(StopRequest):
    """Timestamps the first two should_stop calls, the first before any step (training begins), the
    second after the first step, and then stops (so no evaluation at max_duration muddles the step)."""

    def __init__(self) -> None:
        super().__init__(grace_period=float("inf"))
        self.marks: list[float] = []

    def should_stop(self, state: object = None) -> bool:
        if len(self.marks) < 2:
            self.marks.append(time.perf_counter())
            if len(self.marks) == 2:
                self.request("benchmark: first step done")
        return self.requested


class EventTimes(logging.Handler):
    """perf_counter time of the first occurrence of each structured event (resumed, start, ...), and of
    uploader.sync's "pulled ..." message (the download is committed): a split of the resume from the
    logs alone."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.at: dict[str, float] = {}

    def emit(self, record: logging.LogRecord) -> None:
        name = getattr(record, "event", None)
        if name is None and record.name == "uploader.sync" and str(record.msg).startswith("pulled"):
            name = "pulled"
        if name is not None:
            self.at.setdefault(name, time.perf_counter())


def seed_checkpoint(cfg: Any, url: str, endpoint: str, folder: Path) -> None:
    """Train SEED_STEPS steps and upload the final checkpoint: what every arm resumes from."""
    from job.app import train
    from job.storage import RemoteConfig
    from tests.support.jobs import ckpt_config
    from uploader.config import UploadConfig

    train(cfg, ckpt_config(folder, interval=FOREVER, resume="never"),
          RemoteConfig(url=url, mode="inprocess", upload=UploadConfig(endpoint_url=endpoint, addressing="path")))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--model", default="400MB", help=f"a size ({', '.join(SIZES)}) or a --model spec")
    add_threads_option(p)
    args = p.parse_args(argv)
    apply_threads(args.threads)
    if args.smoke:
        args.model = "smoke"
    rounds = args.rounds or (1 if args.smoke else 3)
    import torch

    import job.app
    from job.app import train
    from job.storage import RemoteConfig
    from tests.support.jobs import ckpt_config, events
    from uploader.config import UploadConfig

    cfg = bench_config(args.model, max_duration=f"{SEED_STEPS}ba")
    resume_cfg = bench_config(args.model, max_duration=f"{SEED_STEPS + 2}ba")
    print_machine(args.tmpdir)
    with scratch("resume", args.tmpdir) as workdir, s3_bucket(workdir) as bucket:
        url = bucket.url("run")
        seed_checkpoint(cfg, url, bucket.endpoint_url, workdir / "seed")
        state_key = f"s3://{bucket.name}/run/step-{SEED_STEPS:012d}/{STATE_FILE}"
        size = (workdir / "seed" / f"step-{SEED_STEPS:012d}" / STATE_FILE).stat().st_size
        progress(f"model {cfg.model}: checkpoint of {human_bytes(size)} at {url}")
        remote = RemoteConfig(url=url, mode="off", upload=UploadConfig(endpoint_url=bucket.endpoint_url,
                                                                       addressing="path"))
        counter = iter(range(10 ** 6))
        env = bucket.env()

        def inprocess(defer: bool = True, check: type = job.app.ResumedCheck) -> dict[str, float]:
            clock, times = FirstSteps(), EventTimes()
            folder = workdir / f"in-{next(counter)}"
            with listening("job", times), listening("uploader.sync", times), \
                    mock.patch.object(job.app, "expects_checkpoint", job.app.expects_checkpoint if defer
                                      else (lambda *_: False)), mock.patch.object(job.app, "ResumedCheck", check):
                started = time.perf_counter()
                outcome = train(resume_cfg, ckpt_config(folder), remote, stop=clock)
            shutil.rmtree(folder)  # like the floor's file: no round leaves its page cache and disk to the next
            assert outcome.state.timer.batch.value == SEED_STEPS + 1 and "resumed" in times.at
            return {"pulled": times.at["pulled"] - started, "resumed": times.at["resumed"] - started,
                    "ready": clock.marks[0] - started, "first_step": clock.marks[1] - started}

        def process() -> dict[str, float]:
            folder = workdir / f"proc-{next(counter)}"
            argv = [sys.executable, "-m", "job", "train", "--model", cfg.model, "--data", cfg.data,
                    "--max-duration", f"{SEED_STEPS + 2}ba", "--batch-size", str(cfg.batch_size),
                    "--lr", str(cfg.lr), "--seed", str(cfg.seed), "--grad-accum", "1", "--device", cfg.device,
                    "--eval-interval", FOREVER, "--save-interval", FOREVER, "--log-interval", "1",
                    "--log-format", "json", "--save-folder", str(folder),
                    "--remote", url, "--upload", "off", "--endpoint-url", bucket.endpoint_url,
                    "--addressing", "path"]
            started = time.time()
            done = subprocess.run(argv, env={**env, "PYTHONUNBUFFERED": "1"}, cwd=REPO, capture_output=True,
                                  text=True, timeout=600)
            shutil.rmtree(folder, ignore_errors=True)
            if done.returncode != 0:
                raise RuntimeError(f"job train failed ({done.returncode}):\n{done.stderr[-2000:]}")
            at = {}
            for e in events(done.stderr):
                at.setdefault(e.get("event"), e["ts"])
            return {"resumed": at["resumed"] - started, "ready": at["start"] - started,
                    "first_step": at["progress"] - started}

        def startup() -> float:
            started = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import job.cli, job.app, uploader.s3"], env=env, cwd=REPO,
                           check=True)
            return time.perf_counter() - started

        def floor() -> dict[str, float]:
            path = workdir / f"floor-{next(counter)}" / STATE_FILE
            path.parent.mkdir()
            started = time.perf_counter()
            subprocess.run([str(venv_binary("s5cmd")), "--endpoint-url", bucket.endpoint_url, "cp", state_key,
                            str(path)], env=env, check=True, capture_output=True)
            downloaded = time.perf_counter()
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            done = time.perf_counter()
            del loaded
            path.unlink()
            return {"download": downloaded - started, "load": done - downloaded, "total": done - started}

        results = interleaved({"inprocess": inprocess, "initialised": lambda: inprocess(defer=False),
                               "at_once": lambda: inprocess(check=AtOnce),
                               "unchecked": lambda: inprocess(check=Unchecked),
                               "process": process, "startup": startup, "floor": floor},
                              rounds=rounds, log=progress)

    def med(arm: str, key: str | None = None) -> float:
        return median([r if key is None else r[key] for r in results[arm]])  # type: ignore[index]

    floor_s, start_s = med("floor", "total"), med("startup")
    print(f"model {cfg.model}, state {human_bytes(size)}, median of {rounds}:")
    print(f"floor: download (s5cmd) {med('floor', 'download'):.2f} s + torch.load {med('floor', 'load'):.2f} s "
          f"= {floor_s:.2f} s")
    print(f"in-process job.app.train: pulled {med('inprocess', 'pulled'):.2f} s (build, S3 client, list, download, "
          f"sha256, commit), resumed {med('inprocess', 'resumed'):.2f} s (+ torch.load, "
          f"load_state_dict), first step starts {med('inprocess', 'ready'):.2f} s, first step done "
          f"{med('inprocess', 'first_step'):.2f} s")
    print(f"the same with the model's random initialisation (not skipped): first step starts "
          f"{med('initialised', 'ready'):.2f} s, {med('initialised', 'ready') / floor_s:.3g}x the floor")
    print("the resumed state's NaN check (job.resumed_check), first step starts / done: beside the first step "
          + ", at once ".join(f"{med(arm, 'ready'):.2f} / {med(arm, 'first_step'):.2f} s"
                              for arm in ("inprocess", "at_once")) + f", none {med('unchecked', 'ready'):.2f} / "
          f"{med('unchecked', 'first_step'):.2f} s")
    print(f"process `job train`: resumed {med('process', 'resumed'):.2f} s, first step starts "
          f"{med('process', 'ready'):.2f} s, first step done {med('process', 'first_step'):.2f} s; "
          f"of which process start-up (python + torch + boto3 imports) {start_s:.2f} s")
    print(ratio("resume/(download+load)", med("inprocess", "ready") / floor_s, TARGET)
          + f" [in-process, to the first step's start]; process: {med('process', 'ready') / floor_s:.3g} "
          f"(vs floor + start-up: {med('process', 'ready') / (floor_s + start_s):.3g})", flush=True)
    return 0


class AtOnce:
    """job.resumed_check's check, waited for before the first step (the bench's ``at_once`` arm)."""

    def __init__(self, state: Any, source: str) -> None:
        from job.resumed_check import ResumedCheck

        self._check = ResumedCheck(state, source)
        self._check.answer()  # before the first step starts
        self.answer, self.close = self._check.answer, self._check.close


class Unchecked:
    """No check of the resumed state at all (the bench's ``unchecked`` arm)."""

    def __init__(self, state: Any, source: str) -> None:
        pass

    def answer(self) -> None:
        pass

    def close(self) -> None:
        pass


if __name__ == "__main__":
    sys.exit(main())
