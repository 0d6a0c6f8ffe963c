"""Run the `job` CLI (one torchrun worker) with its background sharded writes held or failing, for
tests of asynchronous sharded checkpoints across real processes.

Usage: python -m tests.support.gated_sharded_job GATE MODE -- job-args...

MODE:
- ``hold``: every background write of a sharded checkpoint (job.checkpoint's thread, never a durable
  save's write in the training thread) first creates ``GATE/held-<step>-rank<rank>``, then waits until
  the file ``GATE/open`` exists. Training goes on meanwhile: what is written must still be the state
  of the step the checkpoint was taken at.
- ``fail:<n>:<rank>``: the <n>th background write on rank <rank> fails as a full disk would (ENOSPC,
  in DCP's write of the shards); the others are left alone.

What this patches is job.checkpoint's own write step, so the whole asynchronous path (staging, plan,
gather, commit) is the product's.
"""
from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path
from typing import Any

from job import dcp_storage
from job.checkpoint import Checkpointer

gate, mode = Path(sys.argv[1]), sys.argv[2]
args = sys.argv[sys.argv.index("--") + 1:]
rank = int(os.environ.get("RANK", "0"))  # torchrun's; test support, not the product
_real_write_shards = Checkpointer._write_shards


def _held(self: Checkpointer, save: Any, background: bool) -> None:
    if background:
        (gate / f"held-{save.step}-rank{rank}").write_text("")
        while not (gate / "open").exists():
            time.sleep(0.05)
    _real_write_shards(self, save, background)


def _failing(nth: int, failing_rank: int) -> Any:
    count = 0

    def write_shards(self: Checkpointer, save: Any, background: bool) -> None:
        nonlocal count
        if background:
            count += 1
        if background and count == nth and rank == failing_rank:
            def full_disk() -> Any:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            save.dcp = _FullDisk(save.dcp, full_disk)
        _real_write_shards(self, save, background)
    return write_shards


class _FullDisk:
    """A PlannedSave whose write fails; everything else is the real one's."""

    def __init__(self, planned: dcp_storage.PlannedSave, write: Any) -> None:
        self._planned, self.write = planned, write

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planned, name)


if mode == "hold":
    Checkpointer._write_shards = _held  # type: ignore[method-assign]
elif mode.startswith("fail:"):
    _, nth, fail_rank = mode.split(":")
    Checkpointer._write_shards = _failing(int(nth), int(fail_rank))  # type: ignore[method-assign]
else:
    sys.exit(f"gated_sharded_job: MODE must be hold or fail:<n>:<rank>, not {mode!r}")

from job.cli import main  # noqa: E402

main(args)
