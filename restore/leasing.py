"""The restore cache seam: what readers need of a cache (:class:`LeasingCache`) and of a lease
(:class:`ObjectLease`), and the ``verify`` callback type.

Theory of operation
-------------------
Everything that reads stored objects for a restore — :class:`~restore.reader.ChangelogReader`
(segments), the snapshot loading of :func:`~restore.restore.restore_backend` — takes a cache as a
:class:`LeasingCache`: ``lease(store, key, verify=...)`` returns an :class:`ObjectLease` on one
whole object, downloaded and verified at most once per cache, read with exact ranged reads, and
given back by leaving a ``with`` block (or by ``release()``). Two caches implement it:
:class:`~restore.cache.LocalFileCache` (one per process; leases are
:class:`~restore.cache.CacheLease`) and the Spark executor agent's ``AgentCache`` (one cache per
executor, leased over a local socket; leases are ``AgentLease``). Both leases derive from
:class:`~restore.cache.Lease`; readers rely only on this protocol.

A cache in another process cannot be handed a function, so the ``verify`` functions readers use
are also named (:data:`restore.reader.VERIFIERS`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import Protocol

from dstl.stores.base import BlobStore

__all__ = ["LeasingCache", "ObjectLease", "Verify"]

#: ``verify(data, key)`` raises (preferably :class:`~dstl.errors.CorruptObjectError`) when the
#: downloaded bytes are wrong; its return value is ignored.
Verify = Callable[[bytes | memoryview, str], object]


class ObjectLease(Protocol):
    """A lease of one cached object: its size and exact ranged reads, until released."""

    @property
    def key(self) -> str:
        """The object key."""
        ...

    @property
    def size(self) -> int:
        """The object's size in bytes."""
        ...

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes from ``offset``.

        Raises:
            TruncatedObjectError: the object ends before ``offset + length``.
            LeaseError: the lease was released (or its cache closed).
        """
        ...

    def release(self) -> None:
        """Give the lease back (once; a ``with`` block does it)."""

    def __enter__(self) -> ObjectLease: ...

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...


class LeasingCache(Protocol):
    """A restore cache: :class:`~restore.cache.LocalFileCache`, or the Spark executor agent's
    ``AgentCache``."""

    def lease(self, store: BlobStore, key: str, *, verify: Verify | None = None,
              size_hint: int | None = None) -> ObjectLease:
        """Lease the object ``key`` of ``store``, downloading (and verifying, with ``verify``)
        it if this cache does not hold it yet.

        Raises:
            ObjectNotFoundError: the object does not exist.
            CorruptObjectError: ``verify`` rejected the bytes.
            CacheFullError: the object cannot be cached.
        """
        ...
