"""One download of the restore cache: size, budget, GET, verify, a durable file (or direct reads).

Theory of operation
-------------------
:class:`Downloader.fetch` is the I/O of a flight of :class:`~restore.cache.LocalFileCache` (the
cache's module docstring, *Download* and *Budget*), run with no lock held:

1. **Size first.** With a budget, the size is ``size_hint`` or a ``head``; it is reserved in the
   :class:`~restore.cache_book.CacheBook` (a lease may evict idle files, a prefetch may not)
   before the GET, and reserved again if the bytes differ from a hint.
2. **Verify, then write.** The caller's ``verify(data, key)`` runs before anything is written;
   an exception other than a :class:`~dstl.errors.DstlError` is a ``CorruptObjectError``. The
   file is a temp file, ``fsync``-ed and renamed to a name unique per download; any failure
   removes the temp file.
3. **Cannot fit.** Budget exhausted or disk full (``ENOSPC``/``EDQUOT``/``EFBIG``; for the first
   two a lease evicts every idle file and tries once more): a prefetch is skipped
   (:class:`Skipped`), a lease raises :class:`~dstl.errors.CacheFullError` or, with
   ``on_full="direct"``, gets an :class:`~restore.cache_book.Outcome` without a path.
"""

from __future__ import annotations

import errno
import logging
import os
from typing import Literal

from dstl.errors import (
    CacheError,
    CacheFullError,
    CorruptObjectError,
    DstlError,
    LocalDiskFullError,
    ObjectNotFoundError,
    TruncatedObjectError,
)
from dstl.stores.base import BlobStore
from dstl.stores.local import write_new_file_durably
from restore.cache_book import CacheBook, Entry, Outcome
from restore.cache_directory import published_name, temp_name, unlink
from restore.leasing import Verify

__all__ = ["Downloader", "OnFull", "Skipped", "run_verify"]

logger = logging.getLogger(__name__)

OnFull = Literal["raise", "direct"]

_DISK_FULL_ERRNOS = {
    errno.ENOSPC: "the local disk is full (ENOSPC)",
    errno.EDQUOT: "the disk quota is exhausted (EDQUOT)",
    errno.EFBIG: "the file is larger than the filesystem or the process's RLIMIT_FSIZE allows "
                 "(EFBIG)",
}
_DISK_FULL_RETRY_ERRNOS = {errno.ENOSPC, errno.EDQUOT}  # evicting idle files can help these


class Skipped(Exception):
    """A prefetch that does not fit (budget, disk): skipped, never an error."""


class Downloader:
    """Downloads objects into a cache's directory (see the module docstring).

    Args:
        book: the cache's bookkeeping (budget reservations, counters).
        directory: where the files go.
        on_full: what a lease gets when an object cannot be cached.
    """

    def __init__(self, book: CacheBook, directory: str, on_full: OnFull) -> None:
        self._book = book
        self._directory = directory
        self._on_full = on_full

    def fetch(self, entry: Entry, store: BlobStore, key: str, verify: Verify | None,
              size_hint: int | None, *, prefetch: bool = False) -> Outcome:
        """Download ``key`` for ``entry``'s flight.

        Raises:
            Skipped: (``prefetch``) the object does not fit.
            CacheFullError: it does not fit and ``on_full="raise"``.
        """
        book = self._book
        exact = False
        size = size_hint
        if book.max_bytes is not None:
            if size is None:
                size, exact = self._head(store, key), True
            if not book.reserve(entry, size, prefetch=prefetch):
                return self._cannot_fit(store, key, size, exact, book.budget_message(key, size),
                                        prefetch=prefetch)
        if prefetch:
            book.count("prefetch_started")
        data = store.get(key)
        with book.cond:
            book.counts["downloads"] += 1
            book.counts["bytes_downloaded"] += len(data)
            book.cond.notify_all()
        if exact and size is not None and len(data) != size:
            raise TruncatedObjectError(key, min(len(data), size), size, len(data),
                                       "download (size differs from head)")
        if book.max_bytes is not None and len(data) != entry.reserved \
                and not book.reserve(entry, len(data), prefetch=prefetch):
            return self._cannot_fit(store, key, len(data), True,
                                    book.budget_message(key, len(data)), prefetch=prefetch)
        if verify is not None:
            run_verify(verify, data, key)
        try:
            path = self._write_file(store.location, key, data)
        except LocalDiskFullError as full:
            if prefetch:  # evicting to make room is the lease's call, not a hint's
                raise Skipped(f"{full}") from full
            if getattr(full.__cause__, "errno", None) in _DISK_FULL_RETRY_ERRNOS \
                    and book.evict_idle():
                try:
                    path = self._write_file(store.location, key, data)
                except LocalDiskFullError as again:
                    full = again
                else:
                    return Outcome(path, len(data))
            return self._cannot_fit(store, key, len(data), True, f"{full}", full,
                                    hint="free space on that disk, give the cache a directory "
                                         "on a larger disk or a max_bytes below the free space")
        return Outcome(path, len(data))

    def _head(self, store: BlobStore, key: str) -> int:
        info = store.head(key)
        if info is None:
            raise ObjectNotFoundError(f"lease {store.location}/{key}: object not found", key=key)
        return info.size

    def _cannot_fit(self, store: BlobStore, key: str, size: int, exact: bool, message: str,
                    cause: BaseException | None = None, *,
                    hint: str = "raise LocalFileCache(max_bytes=...)",
                    prefetch: bool = False) -> Outcome:
        if prefetch:
            raise Skipped(message) from cause
        if self._on_full == "raise":
            raise CacheFullError(f"{message}; {hint}, or pass on_full='direct' to read such "
                                 "objects with ranged reads from the store") from cause
        if not exact:
            size = self._head(store, key)  # a direct lease needs the real size, not a hint
        logger.warning("restore cache: %s; serving it with direct ranged reads", message)
        return Outcome(None, size)

    def _write_file(self, location: str, key: str, data: bytes) -> str:
        """Temp file, fsync, atomic rename; the temp file is removed on any failure."""
        name = published_name(location, key)
        final = os.path.join(self._directory, name)
        tmp = os.path.join(self._directory, temp_name(name))
        try:
            try:
                write_new_file_durably(tmp, data, 0o600)
                os.rename(tmp, final)  # final is unique: nothing to replace
            except BaseException:
                unlink(tmp)
                raise
        except OSError as exc:
            what = _DISK_FULL_ERRNOS.get(exc.errno or 0)
            if what is not None:
                raise LocalDiskFullError(
                    f"cannot cache {location}/{key} ({len(data)} bytes) in {self._directory}: "
                    f"{what} while writing {tmp}", key=key, path=tmp) from exc
            raise CacheError(f"cannot write the cache file of {location}/{key} in "
                             f"{self._directory} ({exc}); check the local disk") from exc
        return final


def run_verify(verify: Verify, data: bytes, key: str) -> None:
    """Run the caller's check of downloaded bytes; a non-DSTL exception becomes a
    ``CorruptObjectError``."""
    try:
        verify(data, key)
    except DstlError:
        raise
    except Exception as exc:
        raise CorruptObjectError(key, 0, f"verification failed ({type(exc).__name__}: {exc})",
                                 hint="the downloaded object is not what its reader "
                                      "expects") from exc
