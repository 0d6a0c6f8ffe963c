"""Training curves (job.curves): TensorBoard scalars that read back with each step exactly once, across
any number of preemptions, whichever disk each life wrote its event file on."""
from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from job.curves import TENSORBOARD_DIR, recording
from job.logs import listening
from tests.support.jobs import REPO, ckpt_config, train_state
from tests.support.tensorboard import next_second, read_scalars, steps
from uploader import local

LOGGED = [10, 20, 30, 40, 50, 60, 70]  # TINY: 70 batches, a progress event every 10
EVALS = [25, 50, 70]  # every 25 batches, and at the end
CHECKPOINTS = [20, 40, 60, 70]  # every 20 batches, and the final one


class Events:
    """The job's events of one life, as a listener sees them (from any thread)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict]] = []
        self._lock = threading.Lock()

    def __call__(self, name: str, fields: dict) -> None:
        with self._lock:
            self.seen.append((name, dict(fields)))

    def of(self, name: str) -> dict[int, dict]:
        with self._lock:
            return {fields["step"]: fields for n, fields in self.seen if n == name}


def _life(cfg, folder: Path, stop_at: int | None = None) -> Events:
    """One life of the job (job.app.train records its curves: --tensorboard is the default). Checkpoints are
    synchronous: an asynchronous one due while the last is still being written is deferred (README), and on
    two busy cores the writer (nice +10) once had not finished step 20's by step 40, which went to step 42."""
    seen = Events()
    with listening(seen):
        train_state(cfg, ckpt_config(folder, interval="20ba", async_save=False), stop_at=stop_at)
    return seen


def _f32(value: float) -> float:
    return float(np.float32(value))  # TensorBoard keeps a scalar as a float32


def _expected(lives: list[tuple[int, Events]]) -> dict[str, dict[int, float]]:
    """Tag -> step -> value, each step from the life that logged it last: the one a later life did not
    undo (a life resumed from step S undoes what earlier lives logged after S)."""
    out: dict[str, dict[int, float]] = {}
    for start, seen in lives:
        for tag_values in out.values():
            for step in [s for s in tag_values if s > start]:
                del tag_values[step]
        for step, f in seen.of("progress").items():
            out.setdefault("train/loss", {})[step] = _f32(f["loss"])
            out.setdefault("train/lr", {})[step] = _f32(f["lr"])
            out.setdefault("perf/samples_per_sec", {})[step] = _f32(f["samples_per_sec"])
        for step, f in seen.of("eval").items():
            for label, metrics in f["metrics"].items():
                for metric, value in metrics.items():
                    out.setdefault(f"eval/{label}/{metric}", {})[step] = _f32(value)
        for step, f in seen.of("checkpoint").items():
            out.setdefault("checkpoint/stall_seconds", {})[step] = _f32(f["stall"])
            out.setdefault("checkpoint/write_seconds", {})[step] = _f32(f["seconds"])
    return out


def _assert_each_step_once(scalars: dict[str, list[tuple[int, float]]], expected: dict[str, dict[int, float]]) -> None:
    assert scalars.keys() == expected.keys()
    for tag, points in scalars.items():
        assert steps(scalars, tag) == sorted(expected[tag]), tag  # each step exactly once, in order
        assert dict(points) == expected[tag], tag


def test_a_fresh_run_logs_every_scalar_once_at_its_step(tiny_config, tmp_path):
    folder = tmp_path / "ckpt"
    seen = _life(tiny_config(), folder)
    scalars = read_scalars(folder / TENSORBOARD_DIR)

    for tag in ("train/loss", "train/lr", "perf/samples_per_sec"):
        assert steps(scalars, tag) == LOGGED, tag
    eval_tags = [tag for tag in scalars if tag.startswith("eval/")]
    assert eval_tags and all(steps(scalars, tag) == EVALS for tag in eval_tags)
    assert "eval/train/" not in " ".join(eval_tags)  # train metrics are not eval metrics
    for tag in ("checkpoint/stall_seconds", "checkpoint/write_seconds"):
        assert steps(scalars, tag) == CHECKPOINTS, tag
        assert all(value >= 0 for _, value in scalars[tag])
    lrs = [value for _, value in scalars["train/lr"]]
    assert all(lr > 0 for lr in lrs) and lrs[-1] < lrs[0]  # the cosine decay, as the optimizer ran it
    _assert_each_step_once(scalars, _expected([(0, seen)]))  # the values the events carried


def test_the_curves_are_on_disk_when_a_checkpoint_commits(tiny_config, tmp_path, monkeypatch):
    """An upload that starts at a commit (on_commit, right after the event) carries the curves up to it."""
    import job.app

    from torch.utils.tensorboard import SummaryWriter

    folder = tmp_path / "ckpt"
    on_disk: dict[int, tuple[list[int], list[int]]] = {}
    flushes: list[int] = []  # flushes so far, at each commit
    flushed = []
    real_flush = SummaryWriter.flush

    def flush(self) -> None:
        flushed.append(True)
        real_flush(self)

    def at_commit(name: str, fields: dict) -> None:
        if name == "checkpoint":
            flushes.append(len(flushed))
            scalars = read_scalars(folder / TENSORBOARD_DIR)
            on_disk[fields["step"]] = (steps(scalars, "checkpoint/write_seconds"), steps(scalars, "train/loss"))

    @contextlib.contextmanager
    def recording_then_reading(folder: Path, start_step: int):
        with recording(folder, start_step), listening(at_commit):  # listeners run in order: job.curves' first
            yield

    monkeypatch.setattr(job.app, "recording", recording_then_reading)
    monkeypatch.setattr(SummaryWriter, "flush", flush)
    train_state(tiny_config(), ckpt_config(folder, interval="20ba"))
    # The writer's own thread may have written the events by then anyway: the flush is what makes it sure.
    assert flushes == list(range(1, len(flushes) + 1))
    # Reading the files in the writer thread slows the writes, so some checkpoints may come at other steps.
    assert len(on_disk) >= 2 and max(on_disk) == 70
    for step, (checkpoints, losses) in on_disk.items():
        assert checkpoints == sorted(s for s in on_disk if s <= step)
        assert {s for s in LOGGED if s <= step} <= set(losses)


def _kill_after_logging_past_the_checkpoint(cfg, folder: Path) -> Events:
    """Life 1 trains to step 40 with checkpoints at 20 and 40, then the one at 40 is lost, as if the
    machine vanished while writing it: its curves went on past the checkpoint the next life resumes from."""
    seen = _life(cfg, folder, stop_at=40)
    assert sorted(seen.of("progress")) == [10, 20, 30, 40] and sorted(seen.of("checkpoint")) == [20, 40]
    (lost,) = [c for c in local.list_committed(folder) if c.step == 40]
    shutil.rmtree(lost.path)
    return seen


@pytest.mark.parametrize("disk", ["same", "new"])
def test_a_resumed_run_reads_back_each_step_exactly_once(tiny_config, tmp_path, disk):
    """Life 2 resumes from step 20, with another learning rate so that its values differ from life 1's
    after step 20. ``same``: both event files in the save folder. ``new``: life 2 ran on a fresh disk
    that had only the checkpoint (as downloaded); both lives' files meet later in one bucket prefix."""
    first = tmp_path / "life1"
    life1 = _kill_after_logging_past_the_checkpoint(tiny_config(), first)
    raw = read_scalars(first / TENSORBOARD_DIR)
    assert steps(raw, "train/loss") == [10, 20, 30, 40]  # life 1 did log past its checkpoint
    second = first
    if disk == "new":
        second = tmp_path / "life2"
        (kept,) = [c for c in local.list_committed(first) if c.step == 20]
        shutil.copytree(kept.path, second / kept.path.name)
    next_second()  # a later life's event file has a later name (tests.support.tensorboard)
    life2 = _life(tiny_config(lr=6e-3), second)
    assert min(life2.of("progress")) == 30 and life2.of("resumed")[20]

    logdir = first / TENSORBOARD_DIR
    if disk == "new":  # the bucket prefix: every life's files side by side
        logdir = tmp_path / "bucket" / "runlog" / "tensorboard"
        logdir.mkdir(parents=True)
        for life in (first, second):
            for f in (life / TENSORBOARD_DIR).iterdir():
                shutil.copy2(f, logdir / f.name)
    assert len(list(logdir.iterdir())) == 2
    scalars = read_scalars(logdir)

    for tag in ("train/loss", "train/lr", "perf/samples_per_sec"):
        assert steps(scalars, tag) == LOGGED, tag
    assert steps(scalars, "checkpoint/stall_seconds") == CHECKPOINTS
    assert all(steps(scalars, tag) == EVALS for tag in scalars if tag.startswith("eval/"))
    lr = dict(scalars["train/lr"])
    assert lr[30] != _f32(life1.of("progress")[30]["lr"])  # life 2's, not the orphaned life 1's
    _assert_each_step_once(scalars, _expected([(0, life1), (20, life2)]))


def test_a_write_error_ends_the_curves_not_the_training(tiny_config, tmp_path, monkeypatch, caplog):
    from torch.utils.tensorboard import SummaryWriter

    calls = []
    real = SummaryWriter.add_scalar

    def full_disk(self, tag, value, global_step=None, *args, **kw):
        calls.append(tag)
        if len(calls) > 4:
            raise OSError(28, "No space left on device")
        return real(self, tag, value, global_step, *args, **kw)

    monkeypatch.setattr(SummaryWriter, "add_scalar", full_disk)
    folder = tmp_path / "ckpt"
    with caplog.at_level(logging.WARNING, logger="job.curves"):
        seen = _life(tiny_config(), folder)
    assert sorted(seen.of("progress")) == LOGGED and 70 in seen.of("checkpoint")  # training went on to the end
    warnings = [r for r in caplog.records if r.name == "job.curves"]
    assert len(warnings) == 1 and "No space left on device" in warnings[0].getMessage()
    assert len(calls) == 5  # nothing more tried after the failure
    scalars = read_scalars(folder / TENSORBOARD_DIR)
    assert sum(len(points) for points in scalars.values()) == 4  # what was written before it stays


def test_a_folder_that_cannot_hold_the_curves_does_not_stop_training(tiny_config, tmp_path, caplog):
    folder = tmp_path / "ckpt"
    (folder / TENSORBOARD_DIR).parent.mkdir(parents=True)
    (folder / TENSORBOARD_DIR).write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="job.curves"):
        seen = _life(tiny_config(), folder)
    assert sorted(seen.of("progress")) == LOGGED
    assert any("no training curves" in r.getMessage() for r in caplog.records if r.name == "job.curves")


def test_no_tensorboard_flag_reaches_the_config(capsys, tmp_path, monkeypatch):
    import job.app
    from job.app import Outcome
    from job.cli import main

    seen = []

    def fake_train(cfg, ckpt, remote, stop, spot):
        seen.append(cfg.tensorboard)
        return Outcome(None, preempted=False)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job.app, "train", fake_train)
    for argv, env in [([], None), (["--no-tensorboard"], None), ([], "false"), (["--tensorboard"], "false")]:
        if env is None:
            monkeypatch.delenv("JOB_TENSORBOARD", raising=False)
        else:
            monkeypatch.setenv("JOB_TENSORBOARD", env)
        with pytest.raises(SystemExit) as exc:
            main(["train", "--device", "cpu", *argv])
        assert exc.value.code == 0, capsys.readouterr().err
    assert seen == [True, False, False, True]


def test_no_tensorboard_writes_no_curves_and_never_imports_tensorboard(tmp_path):
    """Run in a fresh interpreter, so that what it imports is its own doing. The uploader, which ships
    the curves, imports neither torch nor tensorboard."""
    check = (
        "import sys\n"
        "from pathlib import Path\n"
        "import uploader.cli, uploader.runlog, uploader.worker\n"
        "assert not {'torch', 'tensorboard'} & {m.split('.')[0] for m in sys.modules}, 'the uploader imports them'\n"
        "from tests.support.jobs import ckpt_config, train_config, train_state\n"
        "folder = Path(sys.argv[1])\n"
        "state = train_state(train_config(max_duration='20ba', tensorboard=False), ckpt_config(folder))\n"
        "assert state.timer.batch.value == 20\n"
        "assert not (folder / 'runlog' / 'tensorboard').exists(), 'curves written'\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'tensorboard' or 'torch.utils.tensorboard' in m]\n"
    )
    done = subprocess.run([sys.executable, "-c", check, str(tmp_path / "ckpt")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
