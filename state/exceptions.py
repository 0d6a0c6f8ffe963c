"""Errors of the training state. Each says what is wrong and what to do, in one line."""

from __future__ import annotations


class StateError(Exception):
    """Base class: a state (or checkpoint of one) that cannot be built or restored as asked."""


class PrecisionError(StateError, ValueError):
    """A numerical precision this machine cannot run; a ValueError so that argument parsing can treat it as one."""
