"""Everything ends (issue 16): a server that trickles its responses, which no socket timeout catches,
holds an operation for about max_retry_seconds, not for as long as it likes.

The bounds asserted are generous (seconds, for budgets of one or two): they prove that an operation
ends, not how fast; before uploader.deadline these ran for minutes.
"""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.checkpoints import WITH_LARGE_FILE, make_checkpoint
from tests.support.faultproxy import FaultProxy
from tests.support.polling import outcome_within, wait_until
from tests.support.s3server import Bucket, fast_config
from tests.support.uploader_cli import cli_env, run_cli
from uploader.deadline import Watchdog, bounded, track
from uploader.exceptions import Aborted, DeadlineExceeded, LocalWriteError, TransientStorageError
from uploader.layout import data_key
from uploader.remote import Remote, open_remote
from uploader.sync import push

BUDGET = 2.0  # max_retry_seconds of the trickle tests
ENDS_WITHIN = 20.0  # generous: an operation trickled for its whole response needs minutes
TRICKLE = 0.5  # seconds per byte: each recv gets a byte long before any read timeout


def watchdog_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "uploader-deadline"]


class FakeConnection:
    """What the watchdog needs of a connection: its socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock


# -- the watchdog alone --------------------------------------------------------------------------


def test_a_read_blocked_past_its_deadline_is_cut_and_raises() -> None:
    client, server = socket.socketpair()
    with client, server:
        def attempt() -> bytes:
            track(FakeConnection(client))
            return client.recv(10)  # the peer never sends: only the watchdog ends this

        error = outcome_within(ENDS_WITHIN, lambda: bounded(time.monotonic() + 0.3, attempt, 0.3))

    assert isinstance(error, DeadlineExceeded) and "within the 0.3 s retry budget" in str(error)
    wait_until(lambda: not watchdog_threads(), timeout=5, what="the watchdog thread to exit")


def test_an_attempt_given_up_by_its_caller_is_cut_then_not_at_its_deadline() -> None:
    """An uploader closed after --final-upload-timeout: its request in flight, on a connection that hangs,
    kept the job (and its GPU) for up to the retry budget more; under torchrun the launcher then SIGKILLed
    the rank that had the exit code to give."""
    client, server = socket.socketpair()
    given_up = threading.Event()
    with client, server:
        def attempt() -> bytes:
            track(FakeConnection(client))
            given_up.set()  # the caller gives up while the request waits for its response
            return client.recv(10)

        error = outcome_within(ENDS_WITHIN, lambda: bounded(time.monotonic() + 3600, attempt, 3600, given_up.is_set))

    assert isinstance(error, Aborted) and "stopped on request" in str(error)
    wait_until(lambda: not watchdog_threads(), timeout=5, what="the watchdog thread to exit")


def test_a_socket_its_connection_let_go_of_is_still_cut() -> None:
    """http.client sets ``sock = None`` once a response says "Connection: close"; its body still
    streams from that socket."""
    client, server = socket.socketpair()
    with client, server:
        def attempt() -> bytes:
            conn = FakeConnection(client)
            track(conn)
            conn.sock = None  # type: ignore[assignment]
            return client.recv(10)

        error = outcome_within(ENDS_WITHIN, lambda: bounded(time.monotonic() + 0.3, attempt))

    assert isinstance(error, DeadlineExceeded)


def test_a_full_local_disk_is_not_hidden_by_a_deadline_that_fired_meanwhile() -> None:
    """The cut and the disk error can land in the same attempt; the disk's error is the one to report
    (exit 7, "make room"), not "storage unreachable"."""
    client, server = socket.socketpair()
    with client, server:
        def attempt() -> bytes:
            track(FakeConnection(client))
            client.recv(10)  # ends when the watchdog cuts it
            raise LocalWriteError("cannot write state.pt: No space left on device", "No space left on device")

        error = outcome_within(ENDS_WITHIN, lambda: bounded(time.monotonic() + 0.3, attempt, 0.3))

    assert isinstance(error, LocalWriteError)


def test_attempts_in_parallel_threads_are_cut_each_at_its_own_deadline() -> None:
    """One thread's late attempt is cut; another thread's attempt, in time, keeps its connection."""
    watchdog = Watchdog()
    late_client, late_server = socket.socketpair()
    ok_client, ok_server = socket.socketpair()
    results: dict[str, object] = {}

    def run(name: str, sock: socket.socket, seconds: float) -> None:
        with watchdog.attempt(time.monotonic() + seconds) as attempt:
            watchdog.track(FakeConnection(sock))
            results[name] = sock.recv(10)
        results[f"{name} cut"] = attempt.fired

    with late_client, late_server, ok_client, ok_server:
        threads = [threading.Thread(target=run, args=("late", late_client, 0.3), daemon=True),
                   threading.Thread(target=run, args=("ok", ok_client, 30.0), daemon=True)]
        for t in threads:
            t.start()
        threads[0].join(ENDS_WITHIN)
        ok_server.sendall(b"answer")  # after the late one was cut: the other must still get it
        threads[1].join(ENDS_WITHIN)

    assert results == {"late": b"", "late cut": True, "ok": b"answer", "ok cut": False}
    wait_until(lambda: not watchdog_threads(), timeout=5, what="the watchdog thread to exit")


def test_an_attempt_in_time_returns_its_result_and_leaves_no_thread() -> None:
    assert bounded(time.monotonic() + 30, lambda: 42) == 42
    wait_until(lambda: not watchdog_threads(), timeout=5, what="the watchdog thread to exit")


# -- S3 through a trickling proxy ----------------------------------------------------------------


def trickled(proxy: FaultProxy, bucket: Bucket) -> Remote:
    return open_remote(bucket.url(), fast_config(proxy.endpoint_url, max_retry_seconds=BUDGET))


@pytest.mark.s3
def test_uploader_ls_against_a_trickling_server_exits_5(fault_proxy: FaultProxy, s3_bucket: Bucket,
                                                       tmp_path: Path) -> None:
    fault_proxy.trickle(TRICKLE)

    result = run_cli(["--max-retry-seconds", "2", "ls", s3_bucket.url()],
                     cli_env(s3_bucket, endpoint_url=fault_proxy.endpoint_url), timeout=60)

    assert result.returncode == 5, result.stderr  # given up: a trickle that ends in time answers, and exits 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("uploader: error: list ") and "retry budget" in last and "Traceback" not in result.stderr


@pytest.mark.s3
@pytest.mark.parametrize("operation", ["list", "head", "read_bytes", "write_bytes"])
def test_small_requests_to_a_trickling_server_give_up_within_the_budget(
    fault_proxy: FaultProxy, s3_bucket: Bucket, operation: str
) -> None:
    remote = trickled(fault_proxy, s3_bucket)
    remote.write_bytes("some/object", b"x" * 1000)
    calls: dict[str, Callable[[], object]] = {
        "list": lambda: remote.list("some/"),
        "head": lambda: remote.head("some/object"),
        "read_bytes": lambda: remote.read_bytes("some/object"),
        "write_bytes": lambda: remote.write_bytes("some/other", b"y" * 1000),
    }
    fault_proxy.trickle(TRICKLE)

    error = outcome_within(ENDS_WITHIN, calls[operation])

    assert isinstance(error, TransientStorageError), error
    assert "retry budget" in str(error) and "\n" not in str(error)
    remote.close()


@pytest.mark.s3
def test_a_ranged_download_trickled_mid_body_gives_up_within_the_budget(
    fault_proxy: FaultProxy, s3_bucket: Bucket, tmp_path: Path
) -> None:
    """The ranges stream straight into the file (S3Remote._stream_into): cut there too, in every
    thread of the download."""
    ckpt = make_checkpoint(tmp_path / "local", 10, WITH_LARGE_FILE)
    remote = trickled(fault_proxy, s3_bucket)
    push(ckpt, remote, keep=3)
    [big] = [f for f in ckpt.manifest().files if f.path == "big.bin"]
    # The HEAD answer passes; each range's connection then stalls 100 kB into its 5 MiB body.
    fault_proxy.trickle(TRICKLE, after=100_000)

    error = outcome_within(ENDS_WITHIN, lambda: remote.get_file(
        data_key(ckpt.name, big.path), tmp_path / "big.bin", size=big.size, digest=big.digest,
        algorithm=big.algorithm, block_size=big.block_size))

    assert isinstance(error, TransientStorageError), error
    assert "bytes" in str(error) and "retry budget" in str(error)  # a range failed, not the HEAD
    remote.close()
    wait_until(lambda: not watchdog_threads(), timeout=5, what="the watchdog thread to exit")
