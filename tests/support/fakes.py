"""Fakes at the storage seam: a BlobStore whose puts follow a script (tests never sleep)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from dstl.errors import ThrottledError
from dstl.stores import MemoryBlobStore, ObjectInfo


class DelegatingStore:
    """A BlobStore that forwards everything to a :class:`MemoryBlobStore`; fakes override the
    operations they change."""

    def __init__(self, location: str = "memory://fake") -> None:
        self.inner = MemoryBlobStore(location)
        self.location = self.inner.location

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        return self.inner.get_range(key, offset, length)

    def head(self, key: str) -> ObjectInfo | None:
        return self.inner.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, keys: Iterable[str]) -> None:
        self.inner.delete(keys)

    def close(self) -> None:
        self.inner.close()


class ScriptedStore(DelegatingStore):
    """A :class:`MemoryBlobStore` whose ``put`` calls follow a script, one step per call.

    Steps: ``"ok"``; ``"transient"`` (ConnectionResetError before writing); ``"throttled"``
    (what a 503 SlowDown translates to, before writing); ``"fatal"`` (PermissionError);
    ``"ghost"`` (the write lands, then ConnectionResetError); ``"hang"`` (block until
    :meth:`release_hangs`, then write). After the script, every put is ``"ok"``; with
    ``forever`` set, every put after the script repeats the script's last step.
    """

    def __init__(self, script: Iterable[str] = ()) -> None:
        super().__init__("memory://scripted")
        self.script = list(script)
        self.forever: str | None = None
        self.puts: list[str] = []
        self.deletes: list[str] = []
        self.gets = 0
        self._lock = threading.Condition()
        self._release = threading.Event()
        self.hanging = threading.Semaphore(0)

    def release_hangs(self) -> None:
        self._release.set()

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            step = self.script.pop(0) if self.script else (self.forever or "ok")
            self.puts.append(key)
        if step == "transient":
            raise ConnectionResetError(f"injected reset for {key}")
        if step == "throttled":
            raise ThrottledError(f"put {key}: injected SlowDown", key=key)
        if step == "fatal":
            raise PermissionError(f"injected denial for {key}")
        if step == "hang":
            self.hanging.release()
            self._release.wait(30)
        self.inner.put(key, data)
        if step == "ghost":
            raise ConnectionResetError(f"injected reset after writing {key}")

    def get(self, key: str) -> bytes:
        self.gets += 1
        return self.inner.get(key)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        self.gets += 1
        return self.inner.get_range(key, offset, length)

    def delete(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.inner.delete(keys)
        with self._lock:
            self.deletes.extend(keys)
            self._lock.notify_all()

    def wait_deleted(self, key: str, timeout_s: float = 10.0) -> None:
        """Block until ``key`` was deleted (deletes run on the storage's discard thread)."""
        with self._lock:
            if not self._lock.wait_for(lambda: key in self.deletes, timeout_s):
                raise TimeoutError(f"{key} was not deleted within {timeout_s}s")

    def close(self) -> None:
        self._release.set()

    def stored(self) -> list[str]:
        return [o.key for o in self.inner.list()]
