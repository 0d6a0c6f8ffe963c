"""The ``job`` command's first lines, before torch is imported: a stop signal that arrives before the job
can answer it is exit 75 at once.

Between the process's start and the training loop's own handler (job.signals, installed once the run is
configured and torchrun's rendezvous is joined) lie the import of torch (a second or more), the checks of
the flags and, under torchrun, the wait for every node. Nothing is trained there, so nothing needs saving.
A spot reclaim or ``kubectl delete`` in that window killed the process with SIGTERM (143) or ended it in a
KeyboardInterrupt traceback, which Kubernetes' podFailurePolicy and JobSet's failurePolicy count as a
failure (README, "Exit codes"); 75 is what they restart for free, as for any other stop. The other
commands get Python's usual handlers back once they start (job.cli): ``job inspect`` and ``job report`` have
nothing to resume. ``job launch`` keeps it through torchrun's rendezvous (a launcher waiting for the other nodes
has no worker yet) and answers for itself once torchrun's workers run (job.launch).

This module imports nothing heavy, so that the handler is in place before anything slow runs.
"""
from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import NoReturn

from job.exceptions import EXIT_PREEMPTED  # constants only: no torch

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # job.signals.HANDLED
_exiting = threading.Lock()  # the main thread or job.cli's wakeup thread, whichever runs it first


def stopped_before_start(signum: int, frame: FrameType | None) -> None:
    """The handler outside the training loop's (before it, and in the moment after it, when everything is
    saved): one line, exit 75, no teardown (there is nothing to keep)."""
    if not _exiting.acquire(blocking=False):
        return  # the other thread is ending the process
    name = signal.Signals(signum).name
    os.write(2, f"job: stopped by {name} before training started or after it ended: nothing to save; exiting "
                f"{EXIT_PREEMPTED} (the next start resumes from the newest checkpoint)\n".encode())
    os._exit(EXIT_PREEMPTED)


def main() -> NoReturn:
    for sig in STOP_SIGNALS:
        signal.signal(sig, stopped_before_start)
    from job.cli import main as cli_main

    cli_main()
