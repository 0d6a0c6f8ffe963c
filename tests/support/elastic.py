"""Lives of one run on changing numbers of ranks (issue 17), for tests/job/test_elastic.py and
tests/job/test_sharded.py: torchrun on CPU (gloo) with the recording model, which writes down every
sample it trains on and has no dropout, so results on any rank count differ only by floating-point
order. A global batch of 96 divides among 1, 2 and 3 ranks.
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path

import torch

from job.checkpoint import load_state_file, open_checkpoint
from tests.support.jobs import JobProcess, events, job_env

DATASET = 3072  # spirals' training split
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
ARGS = ["--model", "tests.support.recording_model:build", "--data", "tests.support.recording_model:dataset",
        "--max-duration", "1ep", "--eval-interval", "1ep", "--save-interval", "1000ba", "--log-interval", "2",
        "--seed", "21", "--log-format", "json", "--lr", "0.01"]


def run(ranks: int, folder: Path, record: Path, *extra: str, stop_after: int | None = None) -> JobProcess:
    """One life of the run on ``ranks`` processes; SIGTERM once step ``stop_after`` is logged."""
    record.mkdir(exist_ok=True)
    proc = JobProcess([*TORCHRUN, "--nproc-per-node", str(ranks), "-m", "job", "train", *ARGS, "--save-folder",
                       str(folder), *extra], env=job_env(RECORD_DIR=str(record)))
    with proc:
        if stop_after is not None:
            proc.wait_event("progress", lambda e: e["step"] >= stop_after, timeout=120)
            proc.signal(signal.SIGTERM)  # torchrun passes it on to every worker
        proc.wait(240)
    return proc


def straight_then_resumed(tmp_path: Path, ranks: int, then: int, *extra: str) -> tuple[JobProcess, Path, Path]:
    """The run uninterrupted on ``ranks`` (into ``tmp_path/straight``), and the same run stopped after step 6
    and resumed on ``then`` ranks (``tmp_path/ck``, recording into ``tmp_path/record``), each life checked
    to have ended as it should. The resumed life, its folder and its record."""
    straight = run(ranks, tmp_path / "straight", tmp_path / "record-straight", *extra)
    assert straight.proc.returncode == 0, straight.stderr[-3000:]
    folder, record = tmp_path / "ck", tmp_path / "record"
    first = run(ranks, folder, record, *extra, stop_after=6)
    assert preempted(first), first.stderr[-3000:]
    second = run(then, folder, record, *extra)
    assert second.proc.returncode == 0, second.stderr[-3000:]
    return second, folder, record


def final_model(folder: Path) -> dict[str, torch.Tensor]:
    """The newest checkpoint's weights, sharded ones reassembled."""
    path, manifest = open_checkpoint(folder)
    return load_state_file(path, manifest)["model"]


def assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-3, atol=1e-5), (name, (a[name] - b[name]).abs().max())


def preempted(proc: JobProcess) -> bool:
    return any(e.get("event") == "preempted" for e in events(proc.stderr))


def resumed(*procs: JobProcess) -> list[tuple[int, int]]:
    """(world_size_was, world_size) of every resume, in order."""
    return [(e["world_size_was"], e["world_size"]) for p in procs for e in events(p.stderr) if e.get("event") == "resumed"]
