"""Goodput from the ledger (job.ledger): where a run's wall clock went, life by life.

The categories follow Google's ML Goodput where they fit: *productive* training time, and badput for
start-up (process, imports, building the model), checkpoint restore (waiting for the pull and
loading), the blocking part of checkpoint saves, the synchronous save at preemption, progress lost to
a disruption (steps trained after the checkpoint the next life resumed from, counted at that life's
mean step time), and scheduling (from one life's end to the next one's start). Goodput % is
productive time over the wall clock from the first start to the last end.

Every record comes from a disk or a bucket: it is parsed as untrusted input. Anything malformed or
out of range is skipped with its reason, never evaluated, never fatal.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from job.exceptions import BadRecord
from uploader.manifest import finite_number
from uploader.remote import Remote
from uploader.runlog import LEDGER_DIR, MAX_LEDGER_ENTRY

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # of a ledger record (job.ledger)
KIND = "spot-trainer-life"

LIFE_ID = re.compile(r"life-[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}")
_ENDS = ("finished", "preempted", "failed")
_MAX_CHECKPOINTS = 100_000  # a week at one a second: more is not a record of ours
CATEGORIES = ("productive", "startup", "restore", "checkpoint_stall", "preemption_save", "lost_progress",
              "scheduling", "unaccounted")


@dataclass(frozen=True)
class Checkpoint:
    step: int
    at: float
    stall_s: float
    write_s: float | None
    upload_s: float | None


@dataclass(frozen=True)
class Life:
    life: str
    host: str
    world_size: int
    started: float
    how: str  # fresh, resumed_local, resumed_remote
    from_step: int
    built_at: float | None
    pull_s: float | None  # the bucket download, in the background while the model was built
    restored_at: float | None
    first_step_at: float | None
    checkpoints: tuple[Checkpoint, ...]
    checkpoints_dropped: int  # older checkpoints the record only sums up (job.ledger.MAX_CHECKPOINTS)
    dropped_stall_s: float
    last_step: int
    last_seen: float
    end: str  # finished, preempted, failed, killed (no end recorded)
    end_at: float
    exit_code: int | None
    reason: str | None
    final_save_s: float

    @property
    def checkpoints_taken(self) -> int:
        """Listed one by one, and summed up (older ones)."""
        return len(self.checkpoints) + self.checkpoints_dropped


@dataclass
class LifeCost:
    """One life's seconds by category, and the steps it lost (known once the next life started)."""

    life: Life
    seconds: dict[str, float] = field(default_factory=dict)
    lost_steps: int = 0
    lost_known: bool = True  # False: no later life says where training went on from


def parse_life(raw: bytes) -> Life:
    """One ledger record, validated field by field; BadRecord says what is wrong."""
    if len(raw) > MAX_LEDGER_ENTRY:
        raise BadRecord(f"over {MAX_LEDGER_ENTRY} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise BadRecord(f"not JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict):
        raise BadRecord("not a JSON object")
    if doc.get("kind") != KIND or doc.get("format_version") != FORMAT_VERSION:
        raise BadRecord(f"not a {KIND} record of format {FORMAT_VERSION}")
    life = _str(doc, "life", 64)
    if not LIFE_ID.fullmatch(life):
        raise BadRecord(f"bad life id {life!r}")
    started = _time(doc, "started")
    start = _dict(doc, "start")
    how = _str(start, "how", 32)
    if how not in ("fresh", "resumed_local", "resumed_remote"):
        raise BadRecord(f"bad start {how!r}")
    startup = _dict(doc, "startup")
    raw_ckpts = doc.get("checkpoints")
    if not isinstance(raw_ckpts, list) or len(raw_ckpts) > _MAX_CHECKPOINTS:
        raise BadRecord("checkpoints is not a list of a sane length")
    checkpoints = tuple(Checkpoint(step=_count(c, "step"), at=_time(c, "at"), stall_s=_seconds(c, "stall_s") or 0.0,
                                   write_s=_seconds(c, "write_s"), upload_s=_seconds(c, "upload_s"))
                        for c in (_as_dict(c, "checkpoint") for c in raw_ckpts))
    dropped = doc.get("checkpoints_dropped")
    dropped_count, dropped_stall = 0, 0.0
    if dropped is not None:
        dropped = _as_dict(dropped, "checkpoints_dropped")
        dropped_count, dropped_stall = _count(dropped, "count"), _seconds(dropped, "stall_s") or 0.0
    last_seen = _time(doc, "last_seen")
    end = doc.get("end")
    if end is None:
        how_end, end_at, code, reason, final = "killed", last_seen, None, None, 0.0
    else:
        end = _as_dict(end, "end")
        how_end = _str(end, "how", 32)
        if how_end not in _ENDS:
            raise BadRecord(f"bad end {how_end!r}")
        end_at, code = _time(end, "at"), _count(end, "exit_code")
        reason = _str(end, "reason", 10_000) if isinstance(end.get("reason"), str) else None
        final = _seconds(end, "final_save_s") or 0.0
    if end_at < started or last_seen < started:
        raise BadRecord("ends before it starts")
    return Life(
        life=life, host=_str(doc, "host", 256), world_size=_count(doc, "world_size"), started=started, how=how,
        from_step=_count(start, "from_step"), built_at=_time_or_none(startup, "built_at"),
        pull_s=_seconds(startup, "pull_s"),
        restored_at=_time_or_none(startup, "restored_at"), first_step_at=_time_or_none(startup, "first_step_at"),
        checkpoints=checkpoints, checkpoints_dropped=dropped_count, dropped_stall_s=dropped_stall,
        last_step=_count(doc, "last_step"), last_seen=last_seen, end=how_end,
        end_at=end_at, exit_code=code, reason=(reason or "")[:200] or None, final_save_s=min(final, end_at - started),
    )


def costs(lives: list[Life]) -> list[LifeCost]:
    """Each life's seconds by category, in start order; lost progress needs the next life's start step."""
    ordered = sorted(lives, key=lambda life: life.started)
    result = []
    for i, life in enumerate(ordered):
        nxt = ordered[i + 1] if i + 1 < len(ordered) else None
        cost = LifeCost(life)
        s = cost.seconds
        first = life.first_step_at if life.first_step_at is not None else life.end_at
        first = min(max(first, life.started), life.end_at)
        restore = 0.0
        if life.how != "fresh" and life.built_at is not None and life.restored_at is not None:
            restore = _clamp(life.restored_at - life.built_at, 0.0, first - life.started)
        s["startup"] = first - life.started - restore
        s["restore"] = restore
        training = max(0.0, life.end_at - first - life.final_save_s)
        s["preemption_save"] = life.end_at - first - training
        saves_until = life.end_at - life.final_save_s
        s["checkpoint_stall"] = min(training, life.dropped_stall_s
                                    + sum(c.stall_s for c in life.checkpoints if c.at <= saves_until))
        if nxt is not None:
            cost.lost_steps = max(0, life.last_step - nxt.from_step)
        elif life.end != "finished":
            kept = max((c.step for c in life.checkpoints), default=life.from_step)
            cost.lost_steps, cost.lost_known = max(0, life.last_step - kept), False
        trained = life.last_step - life.from_step
        per_step = (training - s["checkpoint_stall"]) / trained if trained > 0 else 0.0
        s["lost_progress"] = min(training - s["checkpoint_stall"], cost.lost_steps * per_step)
        s["productive"] = training - s["checkpoint_stall"] - s["lost_progress"]
        s["scheduling"] = max(0.0, nxt.started - life.end_at) if nxt is not None else 0.0
        result.append(cost)
    return result


def summary(per_life: list[LifeCost]) -> dict[str, Any]:
    """Totals by category, the wall clock from the first start to the last end, and goodput %."""
    if not per_life:
        return {"wall_s": 0.0, "goodput_percent": None, "seconds": {c: 0.0 for c in CATEGORIES}}
    first = per_life[0].life.started
    last = max(c.life.end_at for c in per_life)
    wall = last - first
    totals = {c: sum(cost.seconds.get(c, 0.0) for cost in per_life) for c in CATEGORIES if c != "unaccounted"}
    totals["unaccounted"] = max(0.0, wall - sum(totals.values()))  # lives that overlap, clocks that disagree
    return {"wall_s": wall, "goodput_percent": 100.0 * totals["productive"] / wall if wall > 0 else None,
            "seconds": totals}


def previous_life(remotes: list[Remote], this_life: str) -> Life | None:
    """The newest valid life that started before ``this_life``, over the save folder and the bucket.

    Life ids sort by start time, so this lists the keys and reads one record (more only when the newest
    are malformed), however long the run's history.
    """
    candidates = []
    for remote in remotes:
        for obj in remote.list(f"{LEDGER_DIR}/"):
            name = obj.key.rpartition("/")[2].removesuffix(".json")
            if LIFE_ID.fullmatch(name) and name < this_life:
                candidates.append((name, obj.key, remote))
    for _, key, remote in sorted(candidates, key=lambda c: c[0], reverse=True):
        raw = remote.read_bytes(key, limit=MAX_LEDGER_ENTRY)
        if raw is None or len(raw) > MAX_LEDGER_ENTRY:
            continue
        try:
            return parse_life(raw)
        except BadRecord as e:
            logger.warning("ledger entry %s skipped: %s", key, e)
    return None


def _as_dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRecord(f"{what} is not an object")
    return value


def _dict(doc: dict[str, Any], key: str) -> dict[str, Any]:
    return _as_dict(doc.get(key), key)


def _str(doc: dict[str, Any], key: str, limit: int) -> str:
    """A string the report can print: control characters (a newline, a terminal's escape sequences) would
    rewrite the screen of whoever reads it, and a lone surrogate (valid JSON) cannot be encoded at all
    (``job report`` ended in a traceback)."""
    value = doc.get(key)
    if not isinstance(value, str) or len(value) > limit or not value.isprintable():
        raise BadRecord(f"{key} is not a printable string of at most {limit} characters")
    return value


def _count(doc: dict[str, Any], key: str) -> int:
    value = doc.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2 ** 63:
        raise BadRecord(f"{key} is not a non-negative integer")
    return value


def _time(doc: dict[str, Any], key: str) -> float:
    value = finite_number(doc.get(key))
    if value is None or not 1e9 <= value <= 1e10:  # 2001 to 2286: anything else is not a Unix time of ours
        raise BadRecord(f"{key} is not a Unix time")
    return value


def _time_or_none(doc: dict[str, Any], key: str) -> float | None:
    return None if doc.get(key) is None else _time(doc, key)


def _seconds(doc: dict[str, Any], key: str) -> float | None:
    if doc.get(key) is None:
        return None
    value = finite_number(doc.get(key))
    if value is None or not 0 <= value <= 1e7:
        raise BadRecord(f"{key} is not a duration in seconds")
    return value


def _clamp(value: float, low: float, high: float) -> float:
    return max(low, min(value, high))
