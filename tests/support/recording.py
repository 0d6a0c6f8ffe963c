"""A Remote wrapper that records which operations ran (and can hold uploads at a gate).

Not a mock: every call goes to the real Remote underneath (SeaweedFS or a folder); the record lets
tests assert *what* the protocol did (which files it re-sent, in which order it deleted).
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from uploader.remote import ObjectInfo, Remote


class RecordingRemote:
    def __init__(self, inner: Remote, gate: threading.Event | None = None) -> None:
        self.inner = inner
        self.url = inner.url
        self.calls: list[tuple[str, Any]] = []
        self.gate = gate  # while set()-less, put_file waits here (first announcing itself on `blocked`)
        self.blocked = threading.Event()
        self._lock = threading.Lock()

    def _record(self, op: str, arg: Any) -> None:
        with self._lock:
            self.calls.append((op, arg))

    def ops(self, op: str) -> list[Any]:
        with self._lock:
            return [arg for name, arg in self.calls if name == op]

    def describe(self) -> str:
        return self.inner.describe()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        self._record("list", prefix)
        return self.inner.list(prefix)

    def head(self, key: str) -> ObjectInfo | None:
        self._record("head", key)
        return self.inner.head(key)

    def read_bytes(self, key: str, limit: int | None = None) -> bytes | None:
        self._record("read_bytes", key)
        return self.inner.read_bytes(key, limit)

    def write_bytes(self, key: str, data: bytes) -> None:
        self._record("write_bytes", key)
        self.inner.write_bytes(key, data)

    def put_file(self, key: str, path: Path, **kwargs: Any) -> None:
        self._record("put_file", key)
        if self.gate is not None:
            self.blocked.set()
            self.gate.wait()
        self.inner.put_file(key, path, **kwargs)

    def get_file(self, key: str, path: Path, **kwargs: Any) -> None:
        self._record("get_file", key)
        self.inner.get_file(key, path, **kwargs)

    def copy(self, source: str, dest: str, *, size: int) -> None:
        self._record("copy", (source, dest))
        self.inner.copy(source, dest, size=size)

    def delete(self, keys: Sequence[str]) -> None:
        self._record("delete", list(keys))
        self.inner.delete(keys)

    def cancel(self) -> None:
        self._record("cancel", None)
        self.inner.cancel()

    def close(self) -> None:
        self.inner.close()
