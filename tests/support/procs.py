"""Finding a launcher's worker processes through /proc (Linux), to kill one rank of a torchrun group."""
from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def worker_of_rank(launcher_pid: int, rank: int) -> int | None:
    for pid in descendants(launcher_pid):
        env = environ(pid)
        if env.get("RANK") == str(rank) and "TORCHELASTIC_RUN_ID" in env:
            return pid
    return None
