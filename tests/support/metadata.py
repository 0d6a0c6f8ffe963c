"""A local stand-in for the AWS (IMDSv2) and GCE metadata servers, on 127.0.0.1 only.

AWS: PUT /latest/api/token (with the TTL header) gives a token; every GET must carry it
(401 otherwise); spot/instance-action and events/recommendations/rebalance answer 404 until a notice
is set. GCE: /computeMetadata/v1/instance/preempted answers FALSE/TRUE and requires
``Metadata-Flavor: Google`` (403 without it).
"""
from __future__ import annotations

import json
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class MetadataServer:
    def __init__(self) -> None:
        self.instance_action: dict[str, Any] | None = None
        self.rebalance: dict[str, Any] | None = None
        self.gce_preempted = False
        self.tokens_issued = 0
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.rejected = 0
        self._valid_tokens: set[str] = set()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, status: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:  # noqa: N802
                server._record("PUT", self.path, dict(self.headers))
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._send(200, server._issue_token())
                else:
                    self._send(400)

            def do_GET(self) -> None:  # noqa: N802
                server._record("GET", self.path, dict(self.headers))
                status, body = server._answer(self.path, self.headers)
                self._send(status, body)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> MetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _record(self, method: str, path: str, headers: dict[str, str]) -> None:
        with self._lock:
            self.requests.append((method, path, headers))

    def _issue_token(self) -> str:
        with self._lock:
            self.tokens_issued += 1
            token = f"token-{self.tokens_issued}"
            self._valid_tokens.add(token)
            return token

    def expire_tokens(self) -> None:
        with self._lock:
            self._valid_tokens.clear()

    def _answer(self, path: str, headers: Any) -> tuple[int, str]:
        if path.startswith("/latest/meta-data/"):
            if headers.get("X-aws-ec2-metadata-token") not in self._valid_tokens:
                self.rejected += 1
                return 401, ""
            item = path.removeprefix("/latest/meta-data/")
            doc = {"spot/instance-action": self.instance_action,
                   "events/recommendations/rebalance": self.rebalance}.get(item)
            return (200, json.dumps(doc)) if doc is not None else (404, "")
        if path == "/computeMetadata/v1/instance/preempted":
            if headers.get("Metadata-Flavor") != "Google":
                self.rejected += 1
                return 403, ""
            return 200, "TRUE" if self.gce_preempted else "FALSE"
        return 404, ""

    def notice_aws(self, seconds_from_now: float, action: str = "terminate") -> None:
        when = datetime.fromtimestamp(datetime.now(timezone.utc).timestamp() + seconds_from_now, timezone.utc)
        self.instance_action = {"action": action, "time": when.strftime("%Y-%m-%dT%H:%M:%SZ")}

    def aws_deadline(self) -> float:
        """The instance action's time, as seconds since the epoch (the notice's deadline, to the second)."""
        assert self.instance_action is not None, "no instance action noticed"
        when = datetime.strptime(self.instance_action["time"], "%Y-%m-%dT%H:%M:%SZ")
        return when.replace(tzinfo=timezone.utc).timestamp()

    def notice_rebalance(self) -> None:
        self.rebalance = {"noticeTime": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
