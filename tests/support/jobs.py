"""Helpers to build tiny training configs and run the `job` CLI as a real process."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from job.config import CheckpointConfig, TrainConfig
from job.schedule import Interval
from job.signals import StopRequest
from state import Precision, State, Time
from tests.support.procs import descendants

REPO = Path(__file__).resolve().parents[2]

# Small enough to run in about a second on two cores; dropout makes RNG restore matter.
TINY = TrainConfig(
    model="mlp", data="spirals", max_duration=Time.from_timestring("70ba"), batch_size=64, lr=3e-3, seed=7,
    device="cpu", precision=Precision.FP32, grad_accum=2, eval_interval=Interval.parse("25ba"),
    log_interval=10, num_workers=0,
)


def train_config(**overrides: Any) -> TrainConfig:
    if isinstance(overrides.get("max_duration"), str):
        overrides["max_duration"] = Time.from_timestring(overrides["max_duration"])
    return replace(TINY, **overrides)


def ckpt_config(folder: Path, interval: str = "1000ba", keep: int = 3, resume: str = "auto",
                async_save: bool = True) -> CheckpointConfig:
    return CheckpointConfig(folder=folder, interval=Interval.parse(interval), keep=keep, resume=resume,
                            async_save=async_save)


def assert_states_equal(a: State, b: State) -> None:
    """Bit-for-bit: parameters, optimizer state, timer, train metric states and computed metrics."""
    for (name, pa), (_, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), f"parameter {name} differs"
    for oa, ob in zip(a.optimizers, b.optimizers, strict=True):
        for sa, sb in zip(oa.state.values(), ob.state.values(), strict=True):
            for key in sa:
                assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), f"optimizer {key} differs"
    assert a.timer.state_dict() == b.timer.state_dict()
    for name in a.train_metrics:
        assert torch.equal(a.train_metrics[name].compute(), b.train_metrics[name].compute()), f"metric {name}"
    assert a.current_metrics.keys() == b.current_metrics.keys()
    for label, metrics in a.current_metrics.items():
        for key, value in metrics.items():
            assert torch.equal(value, b.current_metrics[label][key]), f"{label}/{key} differs"


def job_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOB_", "UPLOADER_"))}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


def job_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "job", *args]


def run_job(*args: str, env: dict[str, str] | None = None, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(job_cmd(*args), env=env or job_env(), capture_output=True, text=True, timeout=timeout,
                          cwd=kw.pop("cwd", REPO), **kw)


def events(stderr: str) -> list[dict[str, Any]]:
    """The JSON log lines a job printed (non-TTY runs log JSON)."""
    out = []
    for line in stderr.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def inspect(path: Path) -> dict[str, Any]:
    done = run_job("inspect", str(path))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


class StopAtStep(StopRequest):
    """A stop request that fires once training reaches ``step``, as a SIGTERM there would."""

    def __init__(self, step: int, grace_period: float = float("inf")) -> None:
        super().__init__(grace_period=grace_period)
        self.step = step

    def should_stop(self, state: object = None) -> bool:
        if isinstance(state, State) and state.timer.batch.value >= self.step and not self.requested:
            self.request(f"test stop at step {self.step}")
        return self.requested


def train_state(cfg: TrainConfig, ckpt: CheckpointConfig, stop_at: int | None = None, **kw: Any) -> State:
    """Run job.app.train in-process and return its final State."""
    from job.app import train

    outcome = train(cfg, ckpt, stop=StopAtStep(stop_at) if stop_at is not None else None, **kw)
    assert outcome.preempted == (stop_at is not None and outcome.state.timer.batch.value < int(cfg.max_duration.value))
    return outcome.state


def _runs_job(argv: list[bytes]) -> bool:
    """`python -m job ...` or the `job` console script (a torchrun launcher would die of SIGUSR1)."""
    module = argv[argv.index(b"-m") + 1] if b"-m" in argv[:-1] else None
    return module == b"job" or any(a.endswith(b"/job") for a in argv[:2])


class JobProcess:
    """A `job` (or any) process whose JSON log lines are collected live, for signal and timing tests."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, cwd: Path = REPO,
                 new_session: bool = False, preexec_fn: Callable[[], None] | None = None) -> None:
        """``new_session``: the process leads a process group of its own, which ``signal_group`` signals
        whole, as a terminal's Ctrl-C does. ``preexec_fn``: as subprocess's (tests.support.disk)."""
        self.proc = subprocess.Popen(argv, env=env or job_env(), cwd=cwd, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, start_new_session=new_session,
                                     preexec_fn=preexec_fn)
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @classmethod
    def job(cls, *args: str, **kw: Any) -> JobProcess:
        return cls(job_cmd(*args), **kw)

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._cond:
            return events("\n".join(self.lines))

    def wait_event(self, name: str, where: Callable[[dict[str, Any]], bool] = lambda e: True,
                   timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for e in events("\n".join(self.lines)):
                    if e.get("event") == name and where(e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"no {name!r} event; log tail:\n" + "\n".join(self.lines[-15:]))
                self._cond.wait(min(left, 0.2))

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def signal_group(self, sig: int) -> None:
        assert os.getpgid(self.proc.pid) == self.proc.pid, "start it with new_session=True"
        os.killpg(self.proc.pid, sig)

    def __enter__(self) -> JobProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        """Whatever the test did with it, nothing it started outlives the block."""
        self.kill()

    def wait(self, timeout: float = 60.0) -> int:
        """The exit code. One still running after ``timeout`` prints its stacks, is killed with all it
        started, and fails the test with its log."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                self.dump_stacks()
            finally:
                self.kill()
            raise AssertionError(f"still running after {timeout} s; log tail:\n" + self.stderr[-8000:]) from None
        self._close()
        return code

    def dump_stacks(self) -> None:
        """Every `job` process in the tree prints its threads' stacks to the log (SIGUSR1, faulthandler)."""
        for pid in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if _runs_job(argv):
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:  # exited since its cmdline was read
                    continue
        time.sleep(2)

    def kill(self) -> None:
        """SIGKILL the process and everything it started (a torchrun launcher's workers are in sessions
        of their own, and outlive a killed launcher otherwise)."""
        if self.proc.poll() is None:
            for pid in [*descendants(self.proc.pid), self.proc.pid]:  # found before the launcher dies
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait(10)
        self._close()

    def _close(self) -> None:
        self._reader.join(5)
        if self.proc.stderr is not None and not self._reader.is_alive():
            self.proc.stderr.close()

    @property
    def stderr(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


def s3_job_env(bucket: Any, credentials: Any = None, **extra: str) -> dict[str, str]:
    """Env for `job` / `uploader` processes using a test bucket: only its credentials, endpoint via env vars."""
    env = {k: v for k, v in bucket.env(credentials).items() if not k.startswith("JOB_")}
    env.update(PYTHONUNBUFFERED="1", JOB_ENDPOINT_URL=bucket.endpoint_url, JOB_ADDRESSING="path",
               UPLOADER_ENDPOINT_URL=bucket.endpoint_url, UPLOADER_ADDRESSING="path", **extra)
    return env
