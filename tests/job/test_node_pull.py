"""job.node_pull's agreement step: every rank of a multi-node resume ends the same way as the node whose
download failed. The collective is replaced by the outcomes other ranks would send (the real one runs in
tests/job/test_multinode.py); the exit codes are the CLI's (job.exceptions.exit_code_for)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from job import distributed, node_pull
from job.exceptions import JobError, exit_code_for
from uploader.exceptions import CorruptCheckpoint, LocalWriteError, TransientStorageError


def other_node_sends(monkeypatch: pytest.MonkeyPatch, outcome: tuple[Any, Any]) -> None:
    monkeypatch.setattr(distributed, "all_gather", lambda mine: [mine, outcome])


def fails_with(error: Exception) -> tuple[None, tuple[str, int]]:
    """What a node whose download raised ``error`` sends to the others."""
    gathered: list[Any] = []

    def step() -> None:
        raise error

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(distributed, "all_gather", lambda mine: gathered.append(mine) or [mine])
        with pytest.raises(type(error)):
            node_pull._agree_on(step)
    return gathered[0]


@pytest.mark.parametrize("error, code", [
    (LocalWriteError("cannot download step-000000000060 (1.0 GiB) into /ck: No space left on device"), 7),
    (TransientStorageError("GET still failing after 8 attempt(s)"), 5),
])
def test_a_node_that_failed_its_download_ends_every_rank_with_its_exit_code(
        monkeypatch: pytest.MonkeyPatch, error: Exception, code: int) -> None:
    other_node_sends(monkeypatch, fails_with(error))
    with pytest.raises(JobError) as raised:
        node_pull._agree_on(lambda: None)  # this node's own download went well
    assert exit_code_for(raised.value) == code
    assert str(raised.value) == (f"another node could not download its part of the checkpoint "
                                 f"({type(error).__name__}: {error})")


def test_a_file_that_failed_verification_on_another_node_is_a_corrupt_checkpoint_here(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def step() -> None:
        raise CorruptCheckpoint("s3://b/run/step-000000000060/__1_0.distcp fails its blake3 check")

    gathered: list[Any] = []
    monkeypatch.setattr(distributed, "all_gather", lambda mine: gathered.append(mine) or [mine])
    corrupt = node_pull._agree_on(step)
    assert corrupt is not None and corrupt.endswith("fails its blake3 check")
    other_node_sends(monkeypatch, gathered[0])
    assert node_pull._agree_on(lambda: None) == corrupt  # the same reason on every rank: set aside, go back


def test_rank_0_failing_to_read_the_bucket_ends_every_rank_with_its_exit_code(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    error = TransientStorageError("LIST on s3://b/run still failing after 8 attempt(s)")
    monkeypatch.setattr(distributed, "rank", lambda: 1)  # this rank waits for rank 0's reading
    monkeypatch.setattr(distributed, "broadcast_choice", lambda mine: (None, (f"TransientStorageError: {error}",
                                                                             exit_code_for(error))))
    with pytest.raises(JobError) as raised:
        node_pull.resume_from_bucket(None, tmp_path, None, -1, {})  # type: ignore[arg-type]
    assert exit_code_for(raised.value) == 5
    assert str(raised.value) == f"rank 0 could not read the bucket (TransientStorageError: {error})"
