"""The in-memory :class:`~dstl.stores.base.BlobStore`: the reference implementation of the seam's
semantics (write-once puts, sorted listings, idempotent deletes), used by tests and benchmarks.
Every key goes through :func:`~dstl.stores.base.check_key`, as in the durable stores.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from dstl.errors import ObjectExistsError, ObjectNotFoundError
from dstl.stores.base import ObjectInfo, check_key

__all__ = ["MemoryBlobStore"]


class MemoryBlobStore:
    """A thread-safe in-memory :class:`BlobStore`; the reference implementation."""

    def __init__(self, location: str = "memory://dstl") -> None:
        self.location = location
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> None:
        check_key(key)
        with self._lock:
            if key in self._objects:
                raise ObjectExistsError(f"put {self.location}/{key}: object already exists "
                                        "(write-once)", key=key)
            self._objects[key] = bytes(data)

    def get(self, key: str) -> bytes:
        check_key(key)
        with self._lock:
            try:
                return self._objects[key]
            except KeyError:
                raise ObjectNotFoundError(f"get {self.location}/{key}: object not found",
                                          key=key) from None

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        if offset < 0 or length < 0:
            raise ValueError(f"bad range offset={offset} length={length}")
        return self.get(key)[offset:offset + length]

    def head(self, key: str) -> ObjectInfo | None:
        check_key(key)
        with self._lock:
            data = self._objects.get(key)
        return None if data is None else ObjectInfo(key, len(data))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        with self._lock:
            items = sorted((k, len(v)) for k, v in self._objects.items() if k.startswith(prefix))
        return iter([ObjectInfo(k, n) for k, n in items])

    def delete(self, keys: Iterable[str]) -> None:
        keys = [check_key(k) for k in keys]
        with self._lock:
            for key in keys:
                self._objects.pop(key, None)

    def close(self) -> None:
        """Nothing to release."""
