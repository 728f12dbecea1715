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
:class:`~restore.lease.Lease`; readers rely only on this protocol.

A cache in another process cannot be handed a function, so the ``verify`` functions readers use
are also named (:data:`restore.reader.VERIFIERS`).

*Prefetch.* ``prefetch(store, objects)`` tells a cache which objects a restore is about to lease,
in the order it will lease them (:class:`PrefetchItem`: the key, the same ``verify`` and size
hint the lease will pass). The cache starts their downloads in the background, so that loading
the first object overlaps downloading the next ones; a later ``lease`` of a prefetched object joins
its download or finds its file. A prefetch is only a hint: it never raises for an object (a failed
or skipped one is forgotten, and the lease downloads it as if no prefetch had happened), and the
returned :class:`PrefetchTicket`'s ``cancel()`` drops what has not started yet (a restore cancels
its ticket when it ends, successful or not).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol

from dstl.stores.base import BlobStore

__all__ = ["LeasingCache", "ObjectLease", "PrefetchItem", "PrefetchTicket", "Verify"]

#: ``verify(data, key)`` raises (preferably :class:`~dstl.errors.CorruptObjectError`) when the
#: downloaded bytes are wrong; its return value is ignored.
Verify = Callable[[bytes | memoryview, str], object]


@dataclass(frozen=True, slots=True)
class PrefetchItem:
    """One object a restore will lease: what its ``lease`` will pass.

    Attributes:
        key: the object key.
        verify: the ``verify`` function the lease will pass (a cache in another process needs
            one of :data:`restore.reader.VERIFIERS`).
        size_hint: the object's size if known (saves a ``head`` when the cache has a budget).
    """

    key: str
    verify: Verify | None = None
    size_hint: int | None = None


class PrefetchTicket(Protocol):
    """What :meth:`LeasingCache.prefetch` returns."""

    def cancel(self) -> None:
        """Drop the ticket's objects whose download has not started (idempotent, never raises);
        an in-process cache also waits (bounded) for the downloads of the ticket in flight, so
        none of its threads outlives the restore."""


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

    def prefetch(self, store: BlobStore, objects: Sequence[PrefetchItem]) -> PrefetchTicket:
        """Start downloading ``objects`` of ``store`` in the background, in this order (each
        at most once however often it is named); a later :meth:`lease` of one of them joins
        its download or finds its file.

        A hint only: objects already cached or in flight are left alone, objects over the
        cache's prefetch budget are skipped, a failed download is forgotten (the lease tries
        again and raises what it raises without a prefetch).

        Raises:
            ClosedError: the cache is closed.
        """
        ...
