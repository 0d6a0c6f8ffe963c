"""Running the ``uploader`` command as a real subprocess, configured the way a pod configures it."""
from __future__ import annotations

import subprocess
import sys
from typing import Any

from tests.support.s3server import Bucket, Credentials


def uploader_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "uploader", *args]


def run_cli(args: list[str], env: dict[str, str], timeout: float = 60, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(uploader_command(*args), env=env, capture_output=True, text=True, timeout=timeout, **kw)


def cli_env(bucket: Bucket, credentials: Credentials | None = None, *, endpoint_url: str | None = None,
            **options: str) -> dict[str, str]:
    """Credentials from the standard AWS variables, every option from its UPLOADER_* variable."""
    env = bucket.env(credentials)
    env.update({"UPLOADER_ENDPOINT_URL": endpoint_url or bucket.endpoint_url, "UPLOADER_ADDRESSING": "path",
                "UPLOADER_MULTIPART_THRESHOLD": "5MiB", "UPLOADER_PART_SIZE": "5MiB"})
    env.update({f"UPLOADER_{k.upper()}": v for k, v in options.items()})
    return env
