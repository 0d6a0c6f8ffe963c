"""Hostile values for the entries of a checkpoint, and the paths of those entries: the sweeps that put
each value in place of each entry in turn (tests/job/test_restore.py, tests/job/test_sharded.py).

A table of damaged cases says what each one must be refused with; a sweep finds the entries and values
nobody thought of. Every crash it found is now a case in a table.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from job.safe_load import first_line as safe_line

DELETED = object()  # what edit() puts in place of an entry it removes

def _shared_deep(depth: int) -> list[Any]:
    """A list of two references to one list, ``depth`` levels down: pickle stores each level once (a few
    bytes), anything that walks it per reference meets 2**depth leaves."""
    shared: list[Any] = [0.5]
    for _ in range(depth):
        shared = [shared, shared]
    return shared


def _holding_itself() -> list[Any]:
    cycle: list[Any] = [0.5]
    cycle.append(cycle)
    return cycle


# Only a pickle can share or loop: JSON writes every reference out.
PICKLE_ONLY: dict[str, Any] = {"a list shared 60 levels deep": _shared_deep(60),
                               "a list that holds itself": _holding_itself()}
HOSTILE: dict[str, Any] = {
    "None": None, "'x'": "x", "-1": -1, "2**70": 2 ** 70, "nan": float("nan"), "{}": {}, "True": True,
    "an empty tensor": torch.zeros(0), "a 3x3 tensor": torch.zeros(3, 3), "tensor(True)": torch.tensor(True),
    "deleted": DELETED, "10**400": 10 ** 400,  # JSON reads it as an int; float() of it overflows
    # What no torch.save of real state writes: no data at all; 2**20 elements on 4 bytes (a stride of 0)
    "a meta tensor": torch.empty((), device="meta"), "an expanded tensor": torch.zeros(1).expand(2 ** 20),
    **PICKLE_ONLY,
}
# What a JSON file can hold in place of an entry (its NaN is refused as JSON, before any field is read).
IN_JSON: dict[str, Any] = {**{name: value for name, value in HOSTILE.items()
                              if not isinstance(value, (torch.Tensor, float)) and name not in PICKLE_ONLY},
                           "0": 0, "0.5": 0.5, "[]": []}


def edit(path: str | tuple[Any, ...], value: Any) -> Callable[[Any], None]:
    """Set (or, with DELETED, remove) the entry at a path: dotted as one string
    ("optimizers.AdamW.param_groups.0.lr", digits index lists and torch's optimizer state), or a tuple
    of the keys themselves (a model's keys hold dots)."""
    keys = path if isinstance(path, tuple) else tuple(path.split("."))
    resolve = isinstance(path, str)

    def apply(tree: Any) -> None:
        node: Any = tree
        for key in keys[:-1]:
            node = node[_key(node, key) if resolve else key]
        last = _key(node, keys[-1]) if resolve else keys[-1]
        if value is DELETED:
            del node[last]
        else:
            node[last] = value
    return apply


def _key(node: Any, key: str) -> Any:
    return int(key) if isinstance(node, list) or (key.isdigit() and key not in node) else key


def entries(node: Any, path: tuple[Any, ...] = (), seen: set[str] | None = None) -> Iterator[tuple[Any, ...]]:
    """The path of every entry under ``node`` (not inside tuples: betas are replaced whole). Of entries whose
    paths differ only in their numbers (each parameter's moments, each layer's weights), only the first."""
    seen = set() if seen is None else seen
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        pattern = re.sub(r"\d+", "N", ".".join(map(str, (*path, key))))
        if pattern not in seen:
            seen.add(pattern)
            yield (*path, key)
            yield from entries(value, (*path, key), seen)


def first_line(error: BaseException) -> str:
    """A sweep's failure as one line: the product's own (job.safe_load), after the exception's type."""
    return f"{type(error).__name__}: {safe_line(error, 200)}"
