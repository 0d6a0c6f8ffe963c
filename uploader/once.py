"""Warnings that a loop would otherwise repeat at every pass.

Retention runs after every save and every upload: a checkpoint it must leave alone (a manifest that
does not parse, another run's newer checkpoint) would be warned about every 30 seconds for as long as
it stays, burying every other line of the log. Each is warned about once per process, at its first
pass; later passes log it at DEBUG.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Hashable

_warned: set[Hashable] = set()
_lock = threading.Lock()


def warn_once(logger: logging.Logger, key: Hashable, message: str, *args: object) -> None:
    """``logger.warning(message, *args)`` the first time ``key`` is seen in this process, DEBUG after.
    ``key`` names the condition (where, which checkpoint, why), not the words: a message that also says
    which upload came upon it differs at each pass."""
    with _lock:
        first = key not in _warned
        _warned.add(key)
    logger.log(logging.WARNING if first else logging.DEBUG, message, *args)
