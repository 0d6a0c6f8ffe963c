"""Run the `job` CLI (under torchrun) with SIGTERM sent to rank 1 alone right after its training loop
returns: after the last step's agree, the final save included, where a spot reclaim of one node can land.

Usage: python -m tests.support.late_signal_job train job-args...
"""
from __future__ import annotations

import os
import signal
import sys

from job import app, distributed
from job.cli import main

_fit = app.Trainer.fit


def _fit_then_signal(self: app.Trainer) -> None:
    _fit(self)
    if distributed.rank() == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # handled here, before the next line of job.app runs


app.Trainer.fit = _fit_then_signal  # type: ignore[method-assign]
sys.argv = ["job", *sys.argv[1:]]
main()
