"""The ledger of lives: one small JSON record per start of ``job train``, next to the checkpoints.

A *life* is one process of the run, from its start to its end (finished, preempted, failed, or killed
with no chance to say so). Its record is built from the job's own events (job.logs.listening), so it
sees exactly what the log says, and is rewritten in place (atomically: a temporary file, then a
rename) after each event that changes it: a SIGKILL leaves the record as of the last progress line.
Only the life that created a record ever writes it; the next life says what the previous one lost
(``previous``) in its own record. ``job report`` (job.goodput) reads them all back as untrusted input.

    <save-folder>/runlog/ledger/life-<YYYYmmddTHHMMSSZ>-<8 hex>.json   uploaded by uploader.runlog

Times are Unix seconds (wall clock, so lives on different machines line up); durations are seconds.
"""
from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from job.exceptions import EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE, exit_code_for
from job.goodput import FORMAT_VERSION, KIND, Life, previous_life
from job.logs import subscribe
from uploader.remote import Remote
from uploader.runlog import LEDGER_DIR

logger = logging.getLogger(__name__)

# The newest checkpoints a record lists one by one (~110 bytes each); older ones are summed up, so a
# life of months still fits goodput's 1 MiB limit on a record and is cheap to rewrite.
MAX_CHECKPOINTS = 2000
READER_GRACE = 2.0  # seconds the end of a life waits for the read of the earlier ones, its remote closed


def process_start_time() -> float:
    """When this process started (Linux: /proc), so that start-up includes the interpreter and imports;
    elsewhere, now. Its age is measured on the boot-time clock /proc counts in, then subtracted from
    the wall clock: /proc/stat's boot time is whole seconds, too coarse to line lives up."""
    try:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - max(0.0, age)  # field 22 of proc(5), starttime, counted after the command name
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


class Ledger:
    """This life's record; a listener of the job's events (``job.logs.listening(ledger)``).

    The record is written once the model is built (a start refused for a bad flag leaves no trace) and
    then after every event that changes it; ``on_written`` (RemoteStore.sync_runlog) is called once the
    first step starts, so that even a life killed before its first checkpoint is in the bucket.
    """

    def __init__(self, folder: Path, world_size: int, previous: Callable[[str], Life | None] | None = None,
                 on_written: Callable[[], None] | None = None, started: float | None = None) -> None:
        started = process_start_time() if started is None else started
        self.life = f"life-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(started))}-{secrets.token_hex(4)}"
        self.path = folder / LEDGER_DIR / f"{self.life}.json"
        self._previous = previous
        self._on_written = on_written
        # Reentrant: a signal handler's event (stop_requested) can arrive in the main thread while it is
        # inside this lock writing the record; those events only note a time and never write.
        self._lock = threading.RLock()
        self._writing = False  # written once the model is built
        self._broken = False
        self._stop_at: float | None = None
        self._unsubscribe: Callable[[], None] = lambda: None
        self._reader: threading.Thread | None = None  # the read of the earlier lives (from the first step)
        self._made: list[Path] = []  # folders created for the record, outermost first
        self.record: dict[str, Any] = {
            "format_version": FORMAT_VERSION, "kind": KIND, "life": self.life, "host": socket.gethostname(),
            "world_size": world_size, "started": round(started, 3), "start": {"how": "fresh", "from_step": 0},
            "startup": {}, "checkpoints": [], "last_step": 0, "last_seen": round(started, 3), "end": None,
            "previous": None,
        }

    @classmethod
    def open(cls, folder: Path, world_size: int, remote: Remote | None,
             on_written: Callable[[], None] | None = None) -> Ledger:
        """A new life's record, listening to the job's events until :meth:`close`. The previous life is
        looked up in the save folder and in ``remote`` (a new disk has only the bucket's records)."""

        def previous(this_life: str) -> Life | None:
            from uploader.config import UploadConfig
            from uploader.remote import open_remote

            remotes = [open_remote(folder.resolve().as_uri(), UploadConfig())] if folder.is_dir() else []
            return previous_life(remotes + ([remote] if remote is not None else []), this_life)

        ledger = cls(folder, world_size, previous, on_written)
        ledger._unsubscribe = subscribe(ledger)
        return ledger

    def close(self) -> None:
        """Stop listening: events after this (another run in the same process) are not this life's."""
        self._unsubscribe()

    def settle(self, timeout: float = READER_GRACE) -> None:
        """Wait, at most ``timeout`` seconds, for the read of the earlier lives, once the remote it may still be
        reading is closed (a storage answering 503 holds it in retries until then): its warning then comes
        before the job's last line, the error, not after it (seen in CI: test_never_lost's exit 5)."""
        if self._reader is not None:
            self._reader.join(timeout)

    def __call__(self, name: str, fields: dict[str, Any]) -> None:
        now = time.time()
        with self._lock:
            changed = self._apply(name, fields, now)
            if changed and self._writing:
                self.record["last_seen"] = round(now, 3)
                self._write()
        if changed and name == "start" and self._on_written is not None:
            self._on_written()  # the life is in the bucket from its first step; its end goes up at close

    def failed(self, error: BaseException) -> None:
        """The life ends with ``error`` (job.app, on its way out), under the exit code the CLI will give it.

        A start refused for its flags (exit 2) before its first step leaves no trace, as everywhere in the
        job: its record, if written, is removed. Nothing is uploaded from here: the storage may be what
        failed, and the uploader's close takes the record up when it still can."""
        code = exit_code_for(error)
        with self._lock:
            if self.record["end"] is not None:
                return
            if code == EXIT_USAGE and "first_step_at" not in self.record["startup"]:
                self._broken = True
                self.path.unlink(missing_ok=True)
                for made in reversed(self._made):  # the folders the record needed, innermost first
                    try:
                        made.rmdir()
                    except OSError:
                        break  # not empty: someone else's now
                return
            self.record["end"] = {"how": "failed", "at": round(time.time(), 3), "exit_code": code,
                                  "error": f"{type(error).__name__}: {error}"[:500], "step": self.record["last_step"]}
            if self._writing:
                self._write()

    def _apply(self, name: str, f: dict[str, Any], now: float) -> bool:
        r = self.record
        startup = r["startup"]
        if name == "built":
            startup["built_at"] = round(now, 3)
            self._writing = True
            return True
        if name == "resume_pulled":  # the pull that overlaps the build (job.storage)
            startup["pull_s"] = f.get("seconds")
            return True
        if name == "resumed":
            source = str(f.get("source", ""))
            r["start"] = {"how": "resumed_remote" if "://" in source else "resumed_local",
                          "from_step": int(f.get("step", 0)), "source": source}
            r["last_step"] = int(f.get("step", 0))
            startup["restored_at"] = round(now, 3)
            return True
        if name == "start":
            startup["first_step_at"] = round(now, 3)
            r["last_step"] = int(f.get("step", 0))
            # Reading the earlier lives may mean the bucket: never on the training thread's way.
            self._reader = threading.Thread(target=self._find_previous, name="ledger-previous", daemon=True)
            self._reader.start()
            return True
        if name in ("progress", "eval"):
            r["last_step"] = max(r["last_step"], int(f.get("step", 0)))
            return True
        if name == "checkpoint":
            r["checkpoints"].append({"step": f.get("step"), "at": round(now, 3), "stall_s": f.get("stall"),
                                     "write_s": f.get("seconds")})
            if len(r["checkpoints"]) > MAX_CHECKPOINTS:  # a record stays small: older ones only as a sum
                oldest = r["checkpoints"].pop(0)
                dropped = r.setdefault("checkpoints_dropped", {"count": 0, "stall_s": 0.0})
                dropped["count"] += 1
                dropped["stall_s"] = round(dropped["stall_s"] + (oldest.get("stall_s") or 0.0), 3)
            r["last_step"] = max(r["last_step"], int(f.get("step", 0)))
            return True
        if name == "uploaded":
            for ckpt in reversed(r["checkpoints"]):
                if ckpt["step"] == f.get("step"):
                    ckpt["upload_s"] = f.get("seconds")
                    break
            return True
        if name in ("stop_requested", "spot_notice") and self._stop_at is None:
            self._stop_at = now
            return False
        if name == "preempted":
            r["end"] = {"how": "preempted", "at": round(now, 3), "exit_code": EXIT_PREEMPTED, "reason": f.get("reason"),
                        "step": f.get("step"), "checkpoint_step": f.get("checkpoint_step"),
                        "final_save_s": round(now - self._stop_at, 3) if self._stop_at is not None else None}
            r["last_step"] = max(r["last_step"], int(f.get("step") or 0))
            return True
        if name == "finished":
            r["end"] = {"how": "finished", "at": round(now, 3), "exit_code": EXIT_OK, "step": f.get("step")}
            r["last_step"] = max(r["last_step"], int(f.get("step", 0)))
            return True
        return False

    def _find_previous(self) -> None:
        previous = self._previous_life()
        if previous is not None:
            with self._lock:
                self.record["previous"] = previous
                if self._writing:
                    self._write()

    def _previous_life(self) -> dict[str, Any] | None:
        """What the life before this one trained and lost: known only now, from its record."""
        if self._previous is None:
            return None
        try:
            last = self._previous(self.life)
        except Exception as e:  # noqa: BLE001 - a record, never a reason to stop training
            logger.warning("ledger: cannot read the earlier lives (%s); this life's record will not say what "
                           "the previous one lost", e)
            return None
        if last is None:
            return None
        from_step = self.record["start"]["from_step"]
        return {"life": last.life, "last_step": last.last_step, "end": last.end,
                "lost_steps": max(0, last.last_step - from_step)}

    def _write(self) -> None:
        if self._broken:
            return
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            if not self._made and not self.path.parent.is_dir():
                self._made = [d for d in reversed(self.path.parent.parents) if not d.exists()] + [self.path.parent]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.record, indent=1))
            os.replace(tmp, self.path)
        except OSError as e:
            self._broken = True  # a full disk: the checkpoints say so louder; the record stops here
            logger.warning("ledger: cannot write %s (%s); this life's record stops here", self.path, e.strerror)
