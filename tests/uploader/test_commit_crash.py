"""Issue 16, item 7: a process killed (os._exit) at any point of a commit leaves at least one complete
checkpoint that the next start finds, for a first commit of a step and for a re-save of the same step.

The commit runs in a child process whose file-system calls (fsync, rename, rmtree) count themselves
and kill the process at the N-th one; N goes up until a run completes, so every point is tried.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checkpoints import data_files_of, make_checkpoint
from tests.support.jobs import REPO
from uploader.local import checkpoint_name, clean_staging, list_committed, newest_verified

CHILD = r"""
import os, shutil, sys
from pathlib import Path
from tests.support.checkpoints import make_checkpoint

folder, kill_at = Path(sys.argv[1]), int(sys.argv[2])
calls = 0

def counted(fn):
    def call(*args, **kwargs):
        global calls
        calls += 1
        if calls == kill_at:
            os._exit(9)
        return fn(*args, **kwargs)
    return call

os.fsync, os.rename, os.replace, shutil.rmtree = (counted(f) for f in (os.fsync, os.rename, os.replace, shutil.rmtree))
make_checkpoint(folder, 8, seed=99)  # staging, data fsync, manifest last, rename(s), cleanup
"""


@pytest.mark.parametrize("resave", [False, True], ids=["first-commit", "same-step-resave"])
def test_a_kill_at_any_point_of_a_commit_leaves_a_complete_checkpoint(tmp_path: Path, resave: bool) -> None:
    new_content = data_files_of(make_checkpoint(tmp_path / "reference", 8, seed=99).path)
    kill_at, outcomes = 1, set()
    while True:
        folder = tmp_path / f"kill-{kill_at}"
        make_checkpoint(folder, 4)
        old_content = data_files_of(make_checkpoint(folder, 8).path) if resave else None
        child = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(kill_at)], cwd=REPO,
                               capture_output=True, text=True, timeout=60)
        assert child.returncode in (0, 9), child.stderr

        clean_staging(folder)  # what the next start does first
        found = newest_verified(folder)
        assert found is not None, f"killed at call {kill_at}: no complete checkpoint left"
        steps = [c.step for c in list_committed(folder)]
        if resave or child.returncode == 0:
            assert found[0].step == 8, f"killed at call {kill_at}: step 8 lost ({steps})"
            content = data_files_of(found[0].path)
            assert content in (old_content, new_content)
            outcomes.add("old" if content == old_content else "new")
        else:
            assert found[0].step in (4, 8) and 4 in steps
        assert not any(p.name.startswith(".staging-") for p in folder.iterdir())
        if child.returncode == 0:
            break
        kill_at += 1
    assert kill_at > 3  # the sweep really went through the commit's calls
    assert "new" in outcomes and (not resave or "old" in outcomes)
    assert (folder / checkpoint_name(8)).is_dir()
