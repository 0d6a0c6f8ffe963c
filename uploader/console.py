"""What the CLI shows: log handlers (text on a terminal, JSON lines otherwise) and the ``ls`` listing.

Only uploader.cli calls this; the library never configures logging, it only logs. Progress records
(uploader.progress) become one line rewritten in place on a terminal and ordinary JSON lines in a
container log, where a collector parses them.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, TextIO

from uploader.progress import human_bytes
from uploader.redact import redact_text
from uploader.sync import RemoteCheckpoint

# Third-party loggers stay at WARNING whatever --log-level says: at DEBUG they print request
# headers, and we promise to never log anything credential-like. For the same reason both handlers
# redact the userinfo and query string of every URL in a line (uploader.redact), traceback included:
# the library's own messages are redacted at the source, other libraries' texts are not.
QUIET_LOGGERS = ("botocore", "boto3", "urllib3", "s3transfer")
_OURS = "_uploader_console"


def _timestamp(created: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))


class TerminalHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Text lines; progress rewrites one line in place until the transfer ends."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__(stream)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        self._dangling = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            progress = getattr(record, "progress", None)
            if progress is not None:
                self.stream.write("\r" + record.getMessage() + "\x1b[K" + ("\n" if progress["final"] else ""))
                self._dangling = not progress["final"]
            else:
                if self._dangling:
                    self.stream.write("\n")
                    self._dangling = False
                self.stream.write(redact_text(self.format(record)) + "\n")
            self.flush()
        except Exception:  # noqa: BLE001 - logging must never break the upload
            self.handleError(record)


class JsonLinesHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """One JSON object per record, for container logs."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            doc: dict[str, Any] = {
                "ts": round(record.created, 3),  # the key the job's JSON logs use (job.logs)
                "level": record.levelname.lower(),
                "logger": record.name,
                "message": redact_text(record.getMessage()),
            }
            doc.update(getattr(record, "progress", None) or {})
            self.stream.write(json.dumps(doc) + "\n")
            self.flush()
        except Exception:  # noqa: BLE001 - logging must never break the upload
            self.handleError(record)


def setup_logging(level: str, stream: TextIO | None = None) -> None:
    """Install our one handler on the root logger (replacing a previous one of ours)."""
    stream = stream if stream is not None else sys.stderr
    handler: logging.Handler = TerminalHandler(stream) if stream.isatty() else JsonLinesHandler(stream)
    setattr(handler, _OURS, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


def print_checkpoints(ckpts: Sequence[RemoteCheckpoint], stream: TextIO | None = None) -> None:
    """A table on a terminal, one JSON object per checkpoint otherwise."""
    stream = stream if stream is not None else sys.stdout
    if not stream.isatty():
        for c in ckpts:
            stream.write(json.dumps({**asdict(c), "time": _timestamp(c.created)}) + "\n")
        return
    rows = [("STEP", "SIZE", "TIME (UTC)", "STATE")] + [
        (str(c.step), human_bytes(c.size), _timestamp(c.created), "complete" if c.complete else "INCOMPLETE")
        for c in ckpts
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        cells = [cell.rjust(w) if i < 2 else cell.ljust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True))]
        stream.write("  ".join(cells).rstrip() + "\n")
    if not ckpts:
        stream.write("(no checkpoints)\n")
