"""`kill -USR1` prints every thread's stack and the job goes on, whatever its threads are doing."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.support.jobs import REPO

# Threads that start, run Python and end all the time: faulthandler's own SIGUSR1 handler walks their
# frames from inside the signal and crashed (SIGSEGV) within 38 signals here (CPython gh-116008).
CHURN = """
import sys, threading, time
from job.cli import _dump_stacks_on_sigusr1
_dump_stacks_on_sigusr1()
def deep(n):
    return deep(n - 1) if n else sum(range(50))
def churn():
    while True:
        threads = [threading.Thread(target=deep, args=(30,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
threading.Thread(target=churn, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_stack_dumps_do_not_crash_a_job_whose_threads_are_busy(tmp_path):
    log = tmp_path / "stderr"
    with open(log, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-c", CHURN], cwd=REPO, stdout=subprocess.PIPE, stderr=err)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        for _ in range(200):
            os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.01)
        time.sleep(0.5)
        assert proc.poll() is None, f"died with {proc.returncode}"
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    text = log.read_text()
    assert text.count("Current thread") >= 100  # the signals were not merely ignored
    assert 'in deep' in text or 'in churn' in text
