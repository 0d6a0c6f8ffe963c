"""``job report``: the lives of a run and what preemption cost, as text, JSON, or an SVG timeline.

Reads only: the ledger under a remote (s3://, file://) or a save folder, with read-only credentials
enough. The SVG is written by hand (a few rectangles and labels) rather than with a plotting library:
the job image stays as it is, and the file opens in any browser.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict
from html import escape
from pathlib import Path
from typing import Any

from job.exceptions import BadRecord
from job.goodput import CATEGORIES, Life, LifeCost, costs, parse_life, summary
from uploader.remote import Remote
from uploader.runlog import read_ledger

logger = logging.getLogger(__name__)

_LABELS = {"productive": "productive training", "startup": "start-up", "restore": "checkpoint restore",
           "checkpoint_stall": "checkpoint saves (blocking)", "preemption_save": "save at preemption",
           "lost_progress": "progress lost", "scheduling": "between lives (scheduling)",
           "unaccounted": "unaccounted"}
_COLOURS = {"productive": "#2e7d32", "startup": "#9e9e9e", "restore": "#f9a825", "checkpoint_stall": "#1565c0",
            "preemption_save": "#6a1b9a", "lost_progress": "#c62828"}


def load(remote: Remote) -> tuple[list[Life], list[str]]:
    """The valid lives, and one line per entry skipped (malformed, hostile, unreadable)."""
    lives, skipped = [], []
    for key, raw in read_ledger(remote):
        try:
            lives.append(parse_life(raw))
        except BadRecord as e:
            skipped.append(f"{key}: {e}")
            logger.warning("ledger entry %s skipped: %s", key, e)
    return lives, skipped


def as_json(per_life: list[LifeCost], skipped: list[str]) -> dict[str, Any]:
    return {"lives": [{**_life_json(c.life), "seconds": _rounded(c.seconds), "lost_steps": c.lost_steps,
                       "lost_steps_known": c.lost_known} for c in per_life],
            "goodput": {**(s := summary(per_life)), "seconds": _rounded(s["seconds"])},
            "skipped": skipped}


def as_text(per_life: list[LifeCost], skipped: list[str]) -> str:
    rows = [("life", "host", "started (UTC)", "start", "steps", "ckpts", "start-up s", "end", "lost steps")]
    for c in per_life:
        life = c.life
        start = {"fresh": "fresh", "resumed_local": f"local @{life.from_step}",
                 "resumed_remote": f"bucket @{life.from_step}"}[life.how]
        end = {"finished": "finished", "killed": "unknown: killed", "failed": f"failed (exit {life.exit_code})",
               "preempted": f"preempted ({life.reason or 'SIGTERM'})"}[life.end]
        rows.append((life.life, life.host[:20], _utc(life.started), start, f"{life.from_step}-{life.last_step}",
                     str(life.checkpoints_taken), f"{c.seconds['startup'] + c.seconds['restore']:.1f}", end,
                     f"{'' if c.lost_known else '>='}{c.lost_steps}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    s = summary(per_life)
    lines += ["", f"wall clock {s['wall_s']:.1f} s from the first start to the last end; goodput "
              + (f"{s['goodput_percent']:.1f} %" if s["goodput_percent"] is not None else "n/a")]
    for category in CATEGORIES:
        seconds = s["seconds"][category]
        share = 100.0 * seconds / s["wall_s"] if s["wall_s"] > 0 else 0.0
        lines.append(f"  {_LABELS[category]:<28} {seconds:9.1f} s  {share:5.1f} %")
    lines += [f"skipped {line}" for line in skipped]
    return "\n".join(lines)


def as_svg(per_life: list[LifeCost]) -> str:
    """One bar per life on a shared time axis: start-up, restore, training, blocking saves, the save at
    preemption and the lost work (the end of the training before the next life's resume point)."""
    width, left, row, top = 960, 230, 34, 40
    if not per_life:
        return _svg(width, top + 40, [f'<text x="10" y="30">no lives recorded</text>'])
    t0 = per_life[0].life.started
    span = max(max(c.life.end_at for c in per_life) - t0, 1e-3)
    scale = (width - left - 20) / span
    x = lambda t: left + (t - t0) * scale  # noqa: E731
    parts = [f'<text x="10" y="24" font-weight="bold">{len(per_life)} lives, goodput '
             f'{_pct(summary(per_life)["goodput_percent"])}</text>']
    for i, c in enumerate(per_life):
        life, y = c.life, top + i * row
        parts.append(f'<text x="10" y="{y + 17}">{escape(life.life)}</text>')
        cursor = life.started
        for category in ("startup", "restore"):
            parts.append(_rect(x(cursor), y, c.seconds[category] * scale, category))
            cursor += c.seconds[category]
        training_end = life.end_at - c.seconds["preemption_save"]
        lost_from = training_end - c.seconds["lost_progress"]
        parts.append(_rect(x(cursor), y, (lost_from - cursor) * scale, "productive"))
        parts.append(_rect(x(lost_from), y, (training_end - lost_from) * scale, "lost_progress"))
        parts.append(_rect(x(training_end), y, c.seconds["preemption_save"] * scale, "preemption_save"))
        for ckpt in life.checkpoints:
            parts.append(f'<rect x="{x(ckpt.at):.1f}" y="{y}" width="2" height="22" fill="{_COLOURS["checkpoint_stall"]}">'
                         f'<title>checkpoint step {ckpt.step}, stall {ckpt.stall_s:.3f} s</title></rect>')
        mark = {"finished": ("#2e7d32", "finished"), "preempted": ("#c62828", "preempted"),
                "failed": ("#000000", f"failed {life.exit_code}"), "killed": ("#c62828", "killed")}[life.end]
        parts.append(f'<text x="{x(life.end_at) + 4:.1f}" y="{y + 16}" fill="{mark[0]}" font-size="11">'
                     f'{escape(mark[1])}</text>')
    legend_y = top + len(per_life) * row + 16
    for j, (category, colour) in enumerate(_COLOURS.items()):
        parts.append(f'<rect x="{10 + j * 155}" y="{legend_y}" width="12" height="12" fill="{colour}"/>'
                     f'<text x="{26 + j * 155}" y="{legend_y + 11}" font-size="11">{escape(_LABELS[category])}</text>')
    parts.append(f'<text x="{left}" y="{legend_y + 34}" font-size="11">0 s</text>'
                 f'<text x="{width - 20}" y="{legend_y + 34}" font-size="11" text-anchor="end">{span:.0f} s</text>')
    return _svg(width, legend_y + 44, parts)


def _rect(x0: float, y: int, w: float, category: str) -> str:
    if w <= 0:
        return ""
    return (f'<rect x="{x0:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="22" fill="{_COLOURS[category]}">'
            f'<title>{escape(_LABELS[category])}</title></rect>')


def _svg(width: int, height: int, parts: list[str]) -> str:
    body = "\n".join(p for p in parts if p)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="12">\n<rect width="100%" height="100%" fill="white"/>\n'
            f'{body}\n</svg>\n')


def _life_json(life: Life) -> dict[str, Any]:
    doc = asdict(life)
    doc["checkpoints"] = life.checkpoints_taken
    del doc["checkpoints_dropped"]
    # Start-up split: building (process start to model built), the pull (alongside the build), and the
    # restore the first step waited for after the build (the rest of the pull, then loading).
    doc["startup"] = {"build_s": _span(life.started, life.built_at), "pull_s": life.pull_s,
                      "load_s": _span(life.built_at, life.restored_at) if life.how != "fresh" else None,
                      "first_step_s": _span(life.started, life.first_step_at)}
    return doc


def _span(start: float | None, end: float | None) -> float | None:
    return round(end - start, 3) if start is not None and end is not None else None


def _rounded(seconds: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) for k, v in seconds.items()}


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _pct(value: float | None) -> str:
    return f"{value:.1f} %" if value is not None else "n/a"


def write_plot(path: Path, per_life: list[LifeCost]) -> None:
    path.write_text(as_svg(per_life))


__all__ = ["as_json", "as_svg", "as_text", "costs", "load", "write_plot"]
