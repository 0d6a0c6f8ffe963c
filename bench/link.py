"""A throttled TCP link for the benchmarks: one simulated node's network interface.

Simulated nodes share this machine's loopback, which is faster than any real NIC; in front of the
bucket, each node gets its own :class:`Link`, whose bytes go no faster than ``rate`` bytes per second
each way, summed over all its connections (a NIC is shared by its connections, not per connection).
Loopback only.
"""
from __future__ import annotations

import contextlib
import socket
import threading
import time

CHUNK = 64 * 1024


class _Pace:
    """Bytes no faster than ``rate`` per second, however many threads send them."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = 0.0

    def take(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(self._free_at, now) + n / self.rate
            wait = self._free_at - now - n / self.rate  # send this chunk once the ones before it are out
        if wait > 0:
            time.sleep(wait)


class Link:
    def __init__(self, upstream_port: int, rate: float) -> None:
        self.upstream_port = upstream_port
        self._down, self._up = _Pace(rate), _Pace(rate)
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._closed = threading.Event()
        threading.Thread(target=self._accept, name=f"link-{self.port}", daemon=True).start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closed.set()
        self._server.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            ends = threading.Barrier(2, action=lambda c=client, u=upstream: (c.close(), u.close()))
            for src, dst, pace in ((client, upstream, self._up), (upstream, client, self._down)):
                threading.Thread(target=_pump, args=(src, dst, pace, ends), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket, pace: _Pace, ends: threading.Barrier) -> None:
    """One direction of one connection; the second direction to finish closes both sockets."""
    try:
        while data := src.recv(CHUNK):
            pace.take(len(data))
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        ends.wait()
