"""Text and loaded values as error messages show them: one line, bounded, whatever the checkpoint holds."""
from __future__ import annotations

import re
import reprlib
from typing import Any


def brief(value: Any, limit: int) -> str:
    """``value``'s repr on one line, at most ``limit`` characters ("..." where cut), made with bounded work.

    A checkpoint's values are untrusted, and a full ``repr`` is not bounded by the file's size: pickle shares
    objects, and 1.4 KB held a list shared 40 levels deep, 2**40 elements to print (a start-up hung on its
    error message); an int of more digits than ``str`` converts raises instead. reprlib shows a few levels and
    elements of each container, and cuts strings and numbers."""
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxstring, shown.maxother, shown.maxlong = 3, limit, limit, limit
    shown.maxlist = shown.maxtuple = shown.maxdict = shown.maxset = shown.maxfrozenset = shown.maxdeque = 4
    try:
        text = shown.repr(value)
    except ValueError:  # an int of more digits than str() converts
        text = "an integer too long to show"
    return clip(text, limit)


def clip(text: str, limit: int) -> str:
    """``text`` on one line (a tensor's repr has several) and cut to ``limit`` characters, with "..." when
    cut: error lines stay one readable line."""
    text = re.sub(r"\s*\n\s*", " ", text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
