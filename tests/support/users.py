"""Another user than the files' owner, for what a permission refuses: root reads any file, so a test run as
root runs its command as nobody (setpriv, util-linux), who may not read a root-owned file of mode 600."""
from __future__ import annotations

import os
import shutil

import pytest

NOBODY = 65534


def as_nobody(command: list[str]) -> list[str]:
    """``command`` run as a user other than the files' owner: as nobody, with no supplementary groups, when
    this is root (the test is skipped without setpriv); as it is otherwise, where mode 000 already refuses."""
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: no user here is refused a read")
    return [setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *command]
