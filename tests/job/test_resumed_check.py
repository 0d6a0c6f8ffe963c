"""job.resumed_check: the resumed state is checked for NaN and Inf beside the first step, and answered right
before that step's optimizer update, the first write of the state. The whole resume: tests/job/test_restore.py
(one process, a run that takes no step too) and tests/job/test_sharded.py (a NaN in one rank's shard only)."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
import torch

from job import resumed_check
from job.exceptions import EXIT_BAD_CHECKPOINT, CheckpointLoadError, exit_code_for
from job.resumed_check import ResumedCheck
from state import State
from tests.state.test_finite import Masked, stepped_state


def _with(value: float, where: str = "second moment") -> State:
    """A stepped state with ``value`` in one element of its first parameter's second moment, or its weight."""
    state = stepped_state(Masked())
    target = (state.model.linear.weight if where == "weight"
              else state.optimizers[0].state[state.model.linear.weight]["exp_avg_sq"])
    with torch.no_grad():
        target[1, 2] = value
    return state


def test_a_healthy_state_trains_on_and_the_answer_comes_once() -> None:
    check = ResumedCheck(_with(0.5), "ckpt-4")  # the model's -inf mask is a buffer: no reason
    check.answer()
    check.answer()


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_nan_or_inf_in_the_optimizer_state_is_exit_6_at_the_first_update(value: float) -> None:
    check = ResumedCheck(_with(value), "ckpt-4")
    with pytest.raises(CheckpointLoadError, match=r"^checkpoint ckpt-4 cannot be trained on: its optimizers\.AdamW"
                       r"\.state\.0\.exp_avg_sq holds NaN or Inf, as the state of a run that diverged does; move "
                       "it and any newer checkpoints out of --save-folder and --remote") as refused:
        check.answer()
    assert exit_code_for(refused.value) == EXIT_BAD_CHECKPOINT
    check.answer()  # answered once: the updates after it are not checked again


def test_a_frozen_parameter_holding_nan_is_no_reason() -> None:
    """Training never writes it (state.finite.parameter_keys), as at a write."""
    state = _with(float("nan"), where="weight")
    state.model.linear.weight.requires_grad_(False)
    state.optimizers[0].state.clear()
    ResumedCheck(state, "ckpt-4").answer()


def _held(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Thread]:
    """The check held until the event is set; a thread that sets it a moment after it starts."""
    started, release = threading.Event(), threading.Event()
    real = resumed_check.first_nonfinite

    def held(named: Any) -> str | None:
        started.set()
        release.wait()
        return real(named)

    monkeypatch.setattr(resumed_check, "first_nonfinite", held)
    return started, threading.Thread(target=lambda: (time.sleep(0.2), release.set()))


def test_the_answer_waits_for_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """An answer that did not wait for the check would read no finding yet and train on."""
    started, releaser = _held(monkeypatch)
    check = ResumedCheck(_with(float("nan")), "ckpt-4")
    assert started.wait(60)
    releaser.start()
    with pytest.raises(CheckpointLoadError, match="cannot be trained on"):
        check.answer()
    releaser.join()


def test_closing_waits_for_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that fails before its first update closes the check: no thread is left reading the state at the
    process's exit (a daemon thread inside torch there ends it in 'terminate called without an active exception')."""
    started, releaser = _held(monkeypatch)
    check = ResumedCheck(_with(0.5), "ckpt-4")
    assert started.wait(60)
    releaser.start()
    check.close()
    assert not any(t.name == "resumed-check" for t in threading.enumerate())
    releaser.join()


def test_a_check_that_fails_never_refuses_the_run(monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    def broken(named: Any) -> str | None:
        raise MemoryError("no room to sum")

    monkeypatch.setattr(resumed_check, "first_nonfinite", broken)
    with caplog.at_level(logging.WARNING, logger="job.resumed_check"):
        check = ResumedCheck(_with(float("nan")), "ckpt-4")
        check.answer()
    assert "the resumed state was not checked for NaN or Inf: MemoryError('no room to sum')" in caplog.text
