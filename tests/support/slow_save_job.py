"""Run the `job` CLI with the Nth checkpoint write paused, so a test can signal or kill it mid-save.

Usage: python -m tests.support.slow_save_job MARKER N [WHERE] -- job-args...

WHERE is where the pause sits (the marker file appears when it starts):
- ``commit`` (default): after the state file is written and before the manifest commits it, for
  600 s: the moment a crash would leave a half-made checkpoint behind.
- ``torch-save``: for 3 s inside torch.save's first write of that checkpoint, running torch ops that release and
  retake the GIL: a daemon thread doing that while the interpreter shuts down aborts the process
  ("terminate called without an active exception").
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from uploader import hashing, local

marker, nth = Path(sys.argv[1]), int(sys.argv[2])
split = sys.argv.index("--")
where, args = (sys.argv[3:split] or ["commit"])[0], sys.argv[split + 1:]
_calls = 0

if where == "commit":
    _real_commit = local.commit

    def _paused_commit(staging: Path, manifest):  # type: ignore[no-untyped-def]
        global _calls
        _calls += 1
        if _calls == nth:
            marker.write_text(str(staging))
            time.sleep(600)
        return _real_commit(staging, manifest)

    local.commit = _paused_commit
elif where == "torch-save":
    _real_init, _real_write = hashing.HashingWriter.__init__, hashing.HashingWriter.write

    def _counting_init(self, raw):  # type: ignore[no-untyped-def]
        global _calls
        _calls += 1
        self._pause = _calls == nth
        _real_init(self, raw)

    def _paused_write(self, data):  # type: ignore[no-untyped-def]
        if self._pause:
            self._pause = False
            marker.write_text("writing")
            busy, until = torch.ones(256, 256), time.monotonic() + 3
            while time.monotonic() < until:  # torch ops that release the GIL and take it back, again and again
                busy @ busy
        return _real_write(self, data)

    hashing.HashingWriter.__init__ = _counting_init
    hashing.HashingWriter.write = _paused_write
else:
    sys.exit(f"slow_save_job: WHERE must be commit or torch-save, not {where!r}")

from job.cli import main  # noqa: E402

main(args)
