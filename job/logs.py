"""Logging for the job: human text on a terminal, one JSON object per line elsewhere.

Modules log with ``logging.getLogger(__name__)``; structured events go through :func:`event` so that
both formats carry the same fields. Handlers are configured here only, called from the CLI. Both
formats redact the userinfo and query string of every URL in a line (uploader.redact): an endpoint
written as ``http://user:secret@host`` must not reach a log, whichever library's text carries it.
"""
from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from uploader.redact import redact_text

_RESERVED = {"event", "fields"}
_log = logging.getLogger(__name__)

Listener = Callable[[str, dict[str, Any]], None]
# Replaced whole, never changed in place, and read without a lock: events are also emitted from signal
# handlers (job.signals), which run in the main thread between any two bytecodes, so a lock held by the
# interrupted code would never be released.
_listeners: tuple[Listener, ...] = ()
_listeners_lock = threading.Lock()  # only between subscribe and unsubscribe


def event(logger: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log a structured event (``{"event": name, **fields}`` in JSON mode) and hand it to the listeners."""
    for listener in _listeners:  # first: whoever reads the log line finds the records already updated
        try:
            listener(name, fields)
        except Exception:  # noqa: BLE001 - a record is never a reason to stop training
            _log.warning("a listener of the job's events failed on %r; training goes on", name, exc_info=True)
    text = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
    logger.log(level, "%s %s", name, text, extra={"event": name, "fields": fields})


def subscribe(listener: Listener) -> Callable[[], None]:
    """Call ``listener(name, fields)`` for every event from now on, from whichever thread emits it; returns
    the function that stops it.

    The run's records (job.ledger, job.curves) are built from the same events as the log, but must not
    depend on ``--log-level``: a listener sees every event, whatever reaches the log. A listener must be
    quick and must not raise (it runs on the training thread and on the writer threads), and must not
    block on a lock its own thread may hold: it is also called from signal handlers.
    """
    global _listeners
    with _listeners_lock:
        _listeners = (*_listeners, listener)

    def unsubscribe() -> None:
        global _listeners
        with _listeners_lock:
            _listeners = tuple(other for other in _listeners if other is not listener)

    return unsubscribe


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """:func:`subscribe` for the duration of a block."""
    unsubscribe = subscribe(listener)
    try:
        yield
    finally:
        unsubscribe()


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    return str(value)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        name = getattr(record, "event", None)
        if name is not None:
            doc["event"] = name
            doc.update(getattr(record, "fields", {}))
        else:
            doc["message"] = record.getMessage()
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return redact_text(json.dumps(doc, default=str))


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        return time.strftime(datefmt or "%H:%M:%S", time.localtime(record.created))


def resolve_format(fmt: str) -> str:
    """``auto`` means text on a terminal and JSON when piped (containers, CI, log collectors)."""
    if fmt == "auto":
        return "text" if sys.stderr.isatty() else "json"
    return fmt


def setup_logging(fmt: str = "auto", level: str = "info") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if resolve_format(fmt) == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # botocore is chatty at INFO about credentials sources; keep it at WARNING.
    for noisy in ("botocore", "boto3", "s3transfer", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.captureWarnings(True)
