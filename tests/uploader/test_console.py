"""Progress lines and the ``ls`` listing: rate-limited, readable on a terminal, parseable elsewhere."""
from __future__ import annotations

import io
import json
import logging

import pytest

from uploader.console import JsonLinesHandler, TerminalHandler, print_checkpoints
from uploader.progress import Progress
from uploader.sync import RemoteCheckpoint

CKPTS = [RemoteCheckpoint(120, "step-000000000120", True, 3 * 1024 * 1024, 0.0),
         RemoteCheckpoint(140, "step-000000000140", False, 1024, 60.0)]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_logs_at_most_once_per_interval_with_rate_and_eta(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    progress = Progress("upload step-1", total=100 * 1024 * 1024, clock=clock)
    with caplog.at_level(logging.INFO, logger="uploader.progress"):
        for _ in range(8):  # 8 chunks of 1 MiB in 2 s: 4 MiB/s
            clock.now += 0.25
            progress.add(1024 * 1024)
        progress.close()

    records = [r.progress for r in caplog.records]  # type: ignore[attr-defined]
    assert len(records) == 3  # at 1 s, at 2 s, and the final line
    assert records[1] == {"event": "progress", "what": "upload step-1", "bytes": 8 * 1024 * 1024,
                          "total": 100 * 1024 * 1024, "rate": 4 * 1024 * 1024, "eta": 23.0, "final": False}
    assert records[-1]["final"] is True
    assert "8.0 MiB / 100.0 MiB (8%), 4.0 MiB/s, ETA 23s" in caplog.records[1].getMessage()


def progress_record(final: bool) -> logging.LogRecord:
    record = logging.LogRecord("uploader.progress", logging.INFO, __file__, 1, "upload: 50%", None, None)
    record.progress = {"event": "progress", "bytes": 5, "total": 10, "final": final}
    return record


def test_terminal_rewrites_the_progress_line_in_place() -> None:
    stream = Tty()
    handler = TerminalHandler(stream)
    handler.emit(progress_record(final=False))
    handler.emit(logging.LogRecord("uploader.sync", logging.INFO, __file__, 1, "uploaded", None, None))

    assert stream.getvalue().startswith("\rupload: 50%\x1b[K\n")
    assert stream.getvalue().endswith("INFO uploaded\n")


def test_json_lines_carry_the_progress_fields() -> None:
    stream = io.StringIO()
    JsonLinesHandler(stream).emit(progress_record(final=True))

    doc = json.loads(stream.getvalue())
    assert doc["message"] == "upload: 50%" and doc["bytes"] == 5 and doc["total"] == 10 and doc["level"] == "info"
    assert isinstance(doc["ts"], float) and "time" not in doc  # one timestamp key in job and uploader logs alike


def test_ls_is_a_table_on_a_terminal_and_json_lines_otherwise() -> None:
    tty, pipe = Tty(), io.StringIO()
    print_checkpoints(CKPTS, tty)
    print_checkpoints(CKPTS, pipe)

    table = tty.getvalue().splitlines()
    assert table[0].split() == ["STEP", "SIZE", "TIME", "(UTC)", "STATE"]
    assert table[1].split() == ["120", "3.0", "MiB", "1970-01-01T00:00:00Z", "complete"]
    assert table[2].split()[-1] == "INCOMPLETE"
    rows = [json.loads(line) for line in pipe.getvalue().splitlines()]
    assert [(r["step"], r["complete"], r["time"]) for r in rows] == [(120, True, "1970-01-01T00:00:00Z"),
                                                                     (140, False, "1970-01-01T00:01:00Z")]
