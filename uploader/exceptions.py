"""Errors of the storage side. Each says what is wrong and what to do, in one line."""
from __future__ import annotations


class UploaderError(Exception):
    """Base class: anything the storage side refuses or cannot do."""


class ManifestError(UploaderError):
    """A manifest that cannot be trusted: unknown format, bad JSON, or unsafe paths."""


class CorruptCheckpoint(UploaderError):
    """A checkpoint whose files do not match its manifest (size or sha256), or are missing."""
