"""The test server itself: a port taken between choosing it and weed binding it is not a failed test."""
from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest

from tests.support.s3server import LOOPBACK, SeaweedFS, weed_binary

pytestmark = pytest.mark.s3


def test_a_taken_port_at_first_start_picks_new_ports(tmp_path: Path) -> None:
    weed = weed_binary()
    if weed is None:
        pytest.skip("SeaweedFS's weed binary is not installed")
    server = SeaweedFS(weed, tmp_path / "seaweedfs")
    taken = server.ports["s3.port"]
    with socket.create_server((LOOPBACK, taken)):  # someone else binds it first
        try:
            server.start()
            assert server.ports["s3.port"] != taken
            assert server.client().list_buckets()["ResponseMetadata"]["HTTPStatusCode"] == 200
        finally:
            server.stop()
            shutil.rmtree(server.workdir, ignore_errors=True)


def test_a_session_takes_writes_to_more_buckets_than_weeds_automatic_volume_limit(tmp_path: Path) -> None:
    """Each bucket is a collection with a volume of its own. weed sizes its volume count from the free
    disk (74 volumes on a 75 GiB disk), and a session of tests creates more buckets than that: writes to
    the later ones failed with InternalError ("no free volumes left"), the last tests of a run only."""
    weed = weed_binary()
    if weed is None:
        pytest.skip("SeaweedFS's weed binary is not installed")
    server = SeaweedFS(weed, tmp_path / "seaweedfs")
    server.start()
    try:
        client = server.client()
        buckets = [server.create_bucket() for _ in range(100)]
        for bucket in buckets:
            client.put_object(Bucket=bucket, Key="ckpt/state.pt", Body=b"x" * 1000)  # raises: InternalError
        assert all(client.head_object(Bucket=b, Key="ckpt/state.pt")["ContentLength"] == 1000 for b in buckets)
    finally:
        server.stop()
        shutil.rmtree(server.workdir, ignore_errors=True)
