"""A TCP proxy on 127.0.0.1 that injects network faults in front of the S3 server (stdlib only).

Faults can be switched while traffic flows:

* ``reset_after(n, times, on=None)``: the next ``times`` connections (None: all) that carry data, already
  open ones included, are reset (RST) once ``n`` more bytes have passed in either direction: mid-transfer;
  with ``graceful=True`` they are closed cleanly (FIN) instead, as a server or load balancer that
  gives up on a connection does: the client sees a body that simply ends early. With ``on`` (a regular
  expression), only a connection carrying a request whose request line it matches counts, e.g. the GET of
  one key: which pooled connection carries the next small request (a listing, a HEAD) is the client's
  choice, and one that carries nothing large would take a budget and never spend it;
* ``slow_down(k)``: the next ``k`` requests are answered ``503 Slow Down`` with an S3 XML error body,
  without reaching the server;
* ``delay(seconds)``: sleep before forwarding every chunk (a slow link);
* ``trickle(interval, after=0)``: responses (server to client) go on one byte every ``interval``
  seconds, on every connection, open ones included, once it has forwarded ``after`` more response
  bytes at full speed: a server or middlebox that never stalls long enough for a socket timeout;
* ``corrupt(k, min_length)``: the next ``k`` requests whose body has at least ``min_length`` bytes
  reach the server with the first byte of that body flipped (a bit error no TCP checksum caught);
* ``strip_response_header(name)``: responses on connections opened from then on lose every header
  line called ``name``: a server that does not know that header;
* ``refuse_header(prefix)``: requests with a header whose name starts with ``prefix`` are answered
  ``501 Not Implemented`` (S3's ``NotImplemented``) without reaching the server: a server that
  rejects what it does not support;
* ``deny(fragment, answer=ACCESS_DENIED)``: requests whose request line contains ``fragment`` (a key) are
  answered ``answer`` (by default ``403 Forbidden``, ``AccessDenied``) without reaching the server:
  credentials that lost the right to write there (a policy changed, a role expired) while others still
  work, or a server that answers some requests wrongly;
* ``hold(fragment)``: requests whose request line contains ``fragment`` (a key) wait in the proxy,
  not forwarded, until ``passthrough()``; ``counters.held`` counts them. An upload of that key is then
  surely in flight, whatever the pace of the client: a slow link without the race of switching it on;
* ``passthrough()``: no fault (a stripped header stays stripped).

Requests are framed by parsing HTTP/1.1 heads and Content-Length (all the S3 SDK sends), so the proxy
counts connections and requests: tests assert "no retry storm" with them.
"""
from __future__ import annotations

import collections
import contextlib
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

from tests.support.s3server import LOOPBACK


def s3_error(status: str, code: str, message: str) -> bytes:
    """A whole S3 error response (XML body), closing the connection."""
    body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
            "<RequestId>faultproxy</RequestId></Error>").encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\nConnection: close\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


SLOW_DOWN = s3_error("503 Slow Down", "SlowDown", "Please reduce your request rate.")
NOT_IMPLEMENTED = s3_error("501 Not Implemented", "NotImplemented",
                           "A header you provided implies functionality that is not implemented.")
ACCESS_DENIED = s3_error("403 Forbidden", "AccessDenied", "Access Denied")
PRECONDITION_FAILED = s3_error("412 Precondition Failed", "PreconditionFailed",
                               "At least one of the pre-conditions you specified did not hold")
BUFFER = 64 * 1024


@dataclass
class Counters:
    connections: int = 0
    requests: int = 0
    resets: int = 0
    slowdowns: int = 0
    corrupted: int = 0
    refused: int = 0
    held: int = 0
    request_heads: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # line, lower-case headers

    @property
    def request_lines(self) -> list[str]:
        return [line for line, _ in self.request_heads]


class _Reset(Exception):
    """This connection has had its bytes: reset it."""


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream = (LOOPBACK, upstream_port)
        self.counters = Counters()
        self._lock = threading.Lock()
        self._reset_after: int | None = None
        self._reset_times: int | None = None
        self._graceful = False
        self._reset_on: str | None = None
        self._generation = 0  # bumped by reset_after(): connections then claim a fresh budget
        self._slowdowns = 0
        self._delay = 0.0
        self._trickle: float | None = None
        self._trickle_after = 0
        self._trickle_generation = 0  # bumped by trickle(): connections then count `after` afresh
        self._corrupt = 0
        self._corrupt_min_length = 1
        self._strip: bytes | None = None
        self._refuse: str | None = None
        self._hold: str | None = None
        self._hold_passes = 0  # matching requests still let through before the hold applies
        self._deny: tuple[str, bytes] | None = None
        self._released = threading.Condition(self._lock)
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, name="faultproxy-accept", daemon=True).start()

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    # -- switching faults -----------------------------------------------------------------------

    def passthrough(self) -> None:
        with self._lock:
            self._reset_after, self._reset_times, self._slowdowns, self._delay = None, None, 0, 0.0
            self._trickle, self._hold, self._reset_on, self._deny = None, None, None, None
            self._generation += 1
            self._released.notify_all()

    def reset_after(self, nbytes: int, times: int | None = None, graceful: bool = False, on: str | None = None) -> None:
        with self._lock:
            self._reset_after, self._reset_times, self._graceful, self._reset_on = nbytes, times, graceful, on
            self._generation += 1

    def slow_down(self, requests: int) -> None:
        with self._lock:
            self._slowdowns = requests

    def delay(self, seconds: float) -> None:
        with self._lock:
            self._delay = seconds

    def trickle(self, interval_seconds: float, after: int = 0) -> None:
        with self._lock:
            self._trickle, self._trickle_after = interval_seconds, after
            self._trickle_generation += 1

    def corrupt(self, requests: int, min_length: int = 1) -> None:
        with self._lock:
            self._corrupt, self._corrupt_min_length = requests, min_length

    def strip_response_header(self, name: str) -> None:
        with self._lock:
            self._strip = name.lower().encode("latin-1")

    def refuse_header(self, prefix: str) -> None:
        with self._lock:
            self._refuse = prefix.lower()

    def deny(self, fragment: str, answer: bytes = ACCESS_DENIED) -> None:
        with self._lock:
            self._deny = fragment, answer

    def hold(self, fragment: str, after: int = 0) -> None:
        """Hold the requests whose line holds ``fragment``, once ``after`` of them have gone through."""
        with self._lock:
            self._hold, self._hold_passes = fragment, after

    def close(self) -> None:
        self._closed = True
        with self._lock:
            self._released.notify_all()
        self._listener.close()
        with self._lock:
            for s in list(self._sockets):
                _hard_close(s)

    # -- plumbing -------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.counters.connections += 1
            threading.Thread(target=self._serve, args=(client,), name="faultproxy-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            _hard_close(client)  # server down: the client sees a reset, as with a dead endpoint
            return
        upstream.settimeout(None)
        conn = _Connection(self, client, upstream)
        with self._lock:
            self._sockets.update((client, upstream))
        down = threading.Thread(target=conn.pump_responses, name="faultproxy-down", daemon=True)
        down.start()
        conn.pump_requests()
        down.join()
        with self._lock:
            self._sockets.difference_update((client, upstream))

    def _take_slowdown(self) -> bool:
        with self._lock:
            if self._slowdowns > 0:
                self._slowdowns -= 1
                self.counters.slowdowns += 1
                return True
            return False

    def _refuses(self, headers: dict[str, str]) -> bool:
        with self._lock:
            if self._refuse is None or not any(name.startswith(self._refuse) for name in headers):
                return False
            self.counters.refused += 1
            return True

    def _denial(self, request_line: str) -> bytes | None:
        with self._lock:
            if self._deny is None or self._deny[0] not in request_line:
                return None
            self.counters.refused += 1
            return self._deny[1]

    def _take_corruption(self, length: int) -> bool:
        with self._lock:
            if self._corrupt > 0 and length >= self._corrupt_min_length:
                self._corrupt -= 1
                self.counters.corrupted += 1
                return True
            return False

    def _claim_budget(self, generation: int) -> tuple[int, int | None]:
        """(current generation, byte budget or None) for a connection that last claimed at ``generation``."""
        if generation == self._generation:
            raise AssertionError("caller checks the generation first")
        budget = None
        if self._reset_after is not None and (self._reset_times is None or self._reset_times > 0):
            budget = self._reset_after
            if self._reset_times is not None:
                self._reset_times -= 1
        return self._generation, budget

    def _wait_if_held(self, request_line: str) -> None:
        """Block a held request until passthrough(); on close() the connection is dropped unforwarded."""
        with self._lock:
            if self._hold is None or self._hold not in request_line:
                return
            if self._hold_passes > 0:
                self._hold_passes -= 1
                return
            self.counters.held += 1
            self._released.wait_for(lambda: self._closed or self._hold is None or self._hold not in request_line)
            if self._closed:
                raise OSError("fault proxy closed while holding a request")

    def _current_delay(self) -> float:
        with self._lock:
            return self._delay

    def _current_trickle(self) -> tuple[float | None, int, int]:
        """(interval or None, bytes to pass at full speed first, generation of that setting)."""
        with self._lock:
            return self._trickle, self._trickle_after, self._trickle_generation


class _Connection:
    """One proxied connection: requests framed client->server, responses streamed back."""

    def __init__(self, proxy: FaultProxy, client: socket.socket, upstream: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = upstream
        self.generation = -1
        self.budget: int | None = None
        self.lock = threading.Lock()
        self.dead = False
        self.trickle_generation = 0  # the trickle() setting `fast_left` counts for
        self.fast_left = 0  # response bytes still forwarded at full speed under the current trickle
        with proxy._lock:
            self.strip = proxy._strip
        self.methods: collections.deque[str] = collections.deque()  # requests not answered yet (strip mode only)
        self.request_line = ""  # the last request forwarded (its response follows it)

    def pump_requests(self) -> None:
        buf = b""
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = self.client.recv(BUFFER)
                    if not data:
                        return self._finish()
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                head += b"\r\n\r\n"
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                headers = _headers(head)
                length = int(headers.get("content-length", "0"))
                with self.proxy._lock:
                    self.proxy.counters.requests += 1
                    self.proxy.counters.request_heads.append((request_line, headers))
                if self.strip is not None:
                    self.methods.append(request_line.split(" ", 1)[0])
                self.proxy._wait_if_held(request_line)
                self.request_line = request_line
                denial = self.proxy._denial(request_line)
                for answer, refused in ((SLOW_DOWN, self.proxy._take_slowdown),
                                        (NOT_IMPLEMENTED, lambda: self.proxy._refuses(headers)),
                                        (denial or b"", lambda: denial is not None)):
                    if refused():
                        if "100-continue" not in headers.get("expect", "").lower():
                            buf = self._discard(buf, length)
                        self.client.sendall(answer)
                        return self._finish()
                self._forward(self.upstream, head)
                flip = self.proxy._take_corruption(length)
                body, buf = buf[:length], buf[length:]
                left = length - len(body)
                if body:
                    self._forward(self.upstream, _flipped(body) if flip else body)
                    flip = False
                while left > 0:
                    data = self.client.recv(min(BUFFER, left))
                    if not data:
                        return self._finish()
                    left -= len(data)
                    self._forward(self.upstream, _flipped(data) if flip else data)
                    flip = False
        except _Reset:
            self._reset()
        except OSError:
            self._finish()

    def pump_responses(self) -> None:
        try:
            if self.strip is not None:
                self._pump_stripped_heads(self.strip)
            while data := self.upstream.recv(BUFFER):
                self._forward(self.client, data)
        except _Reset:
            self._reset()
            return
        except OSError:
            pass
        self._finish()

    def _pump_stripped_heads(self, name: bytes) -> None:
        """Forward responses without the header ``name``: framed by Content-Length, matched to their
        requests' methods (a HEAD's response has no body). A chunked response ends the framing: the
        rest of the connection passes as it is (S3 answers uploads with empty bodies)."""
        buf = b""
        while True:
            while b"\r\n\r\n" not in buf:
                data = self.upstream.recv(BUFFER)
                if not data:
                    if buf:
                        self._forward(self.client, buf)
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            kept = [lines[0]] + [line for line in lines[1:] if line.split(b":", 1)[0].strip().lower() != name]
            self._forward(self.client, b"\r\n".join(kept) + b"\r\n\r\n")
            status = int(lines[0].split()[1])
            if 100 <= status < 200:
                continue
            headers = _headers(head + b"\r\n\r\n")
            method = self.methods.popleft() if self.methods else ""
            if "chunked" in headers.get("transfer-encoding", "").lower():
                if buf:
                    self._forward(self.client, buf)
                return
            left = 0 if method == "HEAD" or status in (204, 304) else int(headers.get("content-length", "0"))
            body, buf = buf[:left], buf[left:]
            if body:
                self._forward(self.client, body)
            left -= len(body)
            while left > 0:
                data = self.upstream.recv(min(BUFFER, left))
                if not data:
                    return
                left -= len(data)
                self._forward(self.client, data)

    def _discard(self, buf: bytes, length: int) -> bytes:
        left = length - len(buf[:length])
        rest = buf[length:]
        while left > 0:
            data = self.client.recv(min(BUFFER, left))
            if not data:
                break
            left -= len(data)
        return rest

    def _forward(self, dest: socket.socket, data: bytes) -> None:
        delay = self.proxy._current_delay()
        if delay:
            time.sleep(delay)
        with self.lock:
            with self.proxy._lock:
                if self.generation != self.proxy._generation:
                    on = self.proxy._reset_on
                    if on is None or re.search(on, self.request_line):
                        self.generation, self.budget = self.proxy._claim_budget(self.generation)
                    else:  # not a connection this generation's reset is for, or not yet
                        self.budget = None
            if self.budget is not None:
                if len(data) >= self.budget:
                    allowed, self.budget = data[: self.budget], 0
                    if allowed:
                        dest.sendall(allowed)
                    raise _Reset()
                self.budget -= len(data)
        if dest is self.client:
            self._send_response_bytes(data)
        else:
            dest.sendall(data)

    def _send_response_bytes(self, data: bytes) -> None:
        """To the client, trickled one byte at a time while trickle() says so (re-read at every byte,
        so that passthrough() takes effect mid-response)."""
        sent = 0
        while sent < len(data):
            interval, after, generation = self.proxy._current_trickle()
            if interval is None:
                self.client.sendall(data[sent:])
                return
            if generation != self.trickle_generation:
                self.trickle_generation, self.fast_left = generation, after
            if self.fast_left > 0:
                n = min(self.fast_left, len(data) - sent)
                self.client.sendall(data[sent : sent + n])
                self.fast_left -= n
                sent += n
                continue
            self.client.sendall(data[sent : sent + 1])
            sent += 1
            time.sleep(interval)

    def _reset(self) -> None:
        with self.lock:
            if self.dead:
                return
            self.dead = True
        with self.proxy._lock:
            self.proxy.counters.resets += 1
            graceful = self.proxy._graceful
        if graceful:
            self.dead = False
            return self._finish()
        _hard_close(self.client)
        _hard_close(self.upstream)

    def _finish(self) -> None:
        with self.lock:
            if self.dead:
                return
            self.dead = True
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def _flipped(data: bytes) -> bytes:
    return bytes([data[0] ^ 0xFF]) + data[1:]


def _headers(head: bytes) -> dict[str, str]:
    lines = head.decode("latin-1").split("\r\n")[1:]
    return {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}


def _hard_close(s: socket.socket) -> None:
    """Close with RST instead of FIN: the peer sees 'connection reset'.

    shutdown(SHUT_RD) first: it wakes our other pump thread blocked in recv() on this socket; a bare
    close() would not, and the kernel would keep the connection open until that recv returned.
    """
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    s.close()
