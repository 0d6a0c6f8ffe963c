"""job.ddp_buckets' warm-up leaves nothing behind, on 3 gloo ranks (tests/support/ddp_warmup_check.py): the
bit-exact resume test (test_torchrun) shows the layout; this one the restores, with a forward that registers a
buffer at its first call, which shifted every later buffer when they were put back by position (review 52)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.jobs import REPO, job_env

pytestmark = pytest.mark.slow


def test_the_warm_up_puts_back_buffers_generators_and_gradients_on_three_ranks() -> None:
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           str(REPO / "tests" / "support" / "ddp_warmup_check.py")],
                          env=job_env(PYTHONPATH=str(REPO)), cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and "ok" in done.stdout.splitlines(), done.stdout + done.stderr[-3000:]
