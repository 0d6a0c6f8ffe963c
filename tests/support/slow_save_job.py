"""Run the `job` CLI with the Nth checkpoint commit paused, so a test can SIGKILL it mid-save.

Usage: python -m tests.support.slow_save_job MARKER N -- job-args...
The pause sits after the state file is written and before the manifest commits it: the moment a
crash would leave a half-made checkpoint behind.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from uploader import local

marker, nth, args = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[4:]
_real_commit = local.commit
_calls = 0


def _paused_commit(staging: Path, manifest):  # type: ignore[no-untyped-def]
    global _calls
    _calls += 1
    if _calls == nth:
        marker.write_text(str(staging))
        time.sleep(600)
    return _real_commit(staging, manifest)


local.commit = _paused_commit

from job.cli import main  # noqa: E402

main(args)
