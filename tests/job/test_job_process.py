"""The tests' process wrapper (tests.support.jobs.JobProcess): a run that hangs ends the test with its
log and leaves nothing running, which is why the tests wait on it without a try/finally of their own."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support.jobs import JobProcess
from tests.support.polling import wait_until
from tests.support.procs import descendants

# A launcher whose worker runs in a session of its own, as torchrun's do.
HANGS = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], "
         "start_new_session=True); time.sleep(120)")


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for whoever adopted it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def hanging() -> tuple[JobProcess, int]:
    """The launcher above, started, and its worker's pid."""
    proc = JobProcess([sys.executable, "-c", HANGS])
    wait_until(lambda: descendants(proc.proc.pid), timeout=30, interval=0.05, what="the worker started")
    (worker,) = descendants(proc.proc.pid)
    return proc, worker


def test_a_wait_that_times_out_kills_the_whole_tree_and_fails_with_the_log() -> None:
    proc, worker = hanging()
    with pytest.raises(AssertionError, match="still running after 0.5 s"):
        proc.wait(0.5)
    assert proc.proc.poll() is not None
    wait_until(lambda: gone(worker), timeout=10, interval=0.05, what="the worker killed")


def test_leaving_its_block_kills_it_whatever_the_test_did() -> None:
    proc, worker = hanging()
    with pytest.raises(RuntimeError, match="the test failed"), proc:
        raise RuntimeError("the test failed")
    assert proc.proc.poll() is not None
    wait_until(lambda: gone(worker), timeout=10, interval=0.05, what="the worker killed")
