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
