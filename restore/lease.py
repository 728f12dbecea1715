"""A lease on one cached object: exact ranged reads, released exactly once.

Theory of operation
-------------------
:class:`Lease` is the one implementation of :class:`~restore.leasing.ObjectLease` behind both
caches: :class:`~restore.cache.CacheLease` (a :class:`~restore.cache.LocalFileCache` in this
process) and the Spark executor agent's ``AgentLease`` (the executor's one cache, over a local
socket) derive from it. A lease reads a published file through its own descriptor
(``os.pread``; no shared file position, so leases of one file never disturb each other); a
*direct* lease (``path is None``: the object did not fit in the cache) reads ranges from the
store. Its state goes OPEN -> RELEASED (by :meth:`~Lease.release`, a ``with`` block, or its
owner's :meth:`~Lease.release_quietly`) or OPEN -> INVALIDATED (its cache closed:
:meth:`~Lease.invalidate`); it never goes back. A second explicit release raises
:class:`~dstl.errors.LeaseError`: with a reference count behind it, it would free a file someone
else reads (Flink's FLINK-30561).

The subclass says what releasing means (``_on_released``: give the reference back to its
cache), may count direct reads (``_direct_read``) and refuses a forked child (``_check_pid``).
"""

from __future__ import annotations

import enum
import os
import threading
from types import TracebackType

from dstl.errors import LeaseError, TruncatedObjectError, UsageError
from dstl.stores.base import BlobStore

__all__ = ["Lease"]


class _LeaseState(enum.Enum):
    OPEN = "open"
    RELEASED = "released"
    INVALIDATED = "invalidated"  # the cache was closed


class Lease:
    """A reference to one cached object; read it with :meth:`read`, give it back with
    :meth:`release` or by leaving the ``with`` block. The base of :class:`CacheLease` and of the
    Spark executor agent's lease (``dstl.spark.agent.cache.AgentLease``): reads of a published
    file go through the lease's own descriptor (``os.pread``; no shared file position), reads of
    a *direct* lease (``path is None``) go to the store; a lease is released exactly once.

    Subclasses say what releasing means (:meth:`_on_released`) and may count direct reads
    (:meth:`_direct_read`) or refuse a forked child (:meth:`_check_pid`).

    Attributes:
        key: the object key.
        location: the store's location (for messages).
        size: the object's size in bytes.
        path: the local file, or ``None`` for a direct lease (ranged reads from the store).
    """

    #: How to get a new lease (ends the message of a use after release).
    _NEW_LEASE = "take a new lease"

    def __init__(self, store: BlobStore, key: str, size: int, path: str | None) -> None:
        self._store = store
        self.key = key
        self.location = store.location
        self.size = size
        self.path = path
        self._lock = threading.Lock()
        self._state = _LeaseState.OPEN
        self._fd: int | None = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.location}/{self.key}, size={self.size}, "
                f"{'direct' if self.direct else 'file'}, {self._state.value})")

    @property
    def direct(self) -> bool:
        """Whether reads go straight to the store (the object did not fit in the cache)."""
        return self.path is None

    @property
    def released(self) -> bool:
        """Whether the lease was released (or invalidated by closing the cache)."""
        return self._state is not _LeaseState.OPEN

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._release(explicit=False)

    def read(self, offset: int, length: int) -> bytes:
        """Return exactly ``length`` bytes from ``offset``.

        Args:
            offset: byte offset in the object (>= 0).
            length: bytes wanted (>= 0).

        Returns:
            The bytes.

        Raises:
            LeaseError: the lease was released, or the cache was closed.
            TruncatedObjectError: the object ends before ``offset + length`` (names key and
                offset).
            UsageError: negative offset or length.
            CacheError: used in a forked child.
            StorageError: (direct leases) the store read failed.
        """
        self._check_pid()
        if offset < 0 or length < 0:
            raise UsageError(f"read of cached {self.location}/{self.key}: bad range "
                             f"offset={offset} length={length} (both must be >= 0)")
        if offset + length > self.size:
            self._check_open("read")
            got = max(0, self.size - offset)
            raise TruncatedObjectError(self.key, offset, length, min(got, length),
                                       f"cached object range (object size {self.size})")
        if self.path is None:
            self._check_open("read")
            data = self._direct_read(offset, length)
        else:
            # The lease lock keeps release()/close() from closing the fd under a running pread.
            with self._lock:
                self._check_open("read")
                assert self._fd is not None
                data = _pread_exact(self._fd, offset, length)
        if len(data) < length:
            raise TruncatedObjectError(self.key, offset + len(data), length, len(data),
                                       "cached object range")
        return data

    def release_quietly(self) -> None:
        """Give the lease back if it is still open, as leaving a ``with`` block does: no error
        when it was released already (the owner of a lease it could not hand out gives it back
        this way).

        Raises:
            CacheError: called in a forked child.
        """
        self._release(explicit=False)

    def invalidate(self) -> None:
        """Close the lease because its cache closed: later reads raise
        :class:`~dstl.errors.LeaseError` naming :meth:`_closed_reason`, and the reference is not
        given back (the cache dropped it already). Idempotent."""
        self._invalidate()

    def release(self) -> None:
        """Give the lease back. After a ``with`` block this is done already.

        Raises:
            LeaseError: the lease was already released explicitly (a double release is a bug in
                the caller: with a reference count it would free a file someone else uses).
            CacheError: called in a forked child.
        """
        self._release(explicit=True)

    # ------------------------------------------------------------------ hooks

    def _check_pid(self) -> None:
        """Raise :class:`~dstl.errors.CacheError` in a process that may not use the lease."""

    def _direct_read(self, offset: int, length: int) -> bytes:
        data: bytes = self._store.get_range(self.key, offset, length)
        return data

    def _on_released(self, *, explicit: bool) -> None:
        """The lease went from open to released: give the reference back."""

    def _closed_reason(self) -> str:
        return "its cache was closed, which invalidated the lease"

    # ------------------------------------------------------------------ internals

    def _check_open(self, what: str) -> None:
        if self._state is _LeaseState.RELEASED:
            raise LeaseError(f"{what} of cached {self.location}/{self.key} after its lease was "
                             f"released ({self._NEW_LEASE})")
        if self._state is _LeaseState.INVALIDATED:
            raise LeaseError(f"{what} of cached {self.location}/{self.key}: "
                             f"{self._closed_reason()}")

    def _release(self, *, explicit: bool) -> None:
        self._check_pid()
        with self._lock:
            if self._state is _LeaseState.RELEASED:
                if explicit:
                    raise LeaseError(f"lease of cached {self.location}/{self.key} released twice "
                                     "(release once, or use the lease as a context manager)")
                return
            was_open = self._state is _LeaseState.OPEN
            self._state = _LeaseState.RELEASED
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
        if was_open:
            self._on_released(explicit=explicit)

    def _invalidate(self) -> None:
        with self._lock:
            if self._state is _LeaseState.OPEN:
                self._state = _LeaseState.INVALIDATED
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)




def _pread_exact(fd: int, offset: int, length: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < length:
        chunk = os.pread(fd, length - got, offset + got)
        if not chunk:
            break  # end of file
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
