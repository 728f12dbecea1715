"""``LocalFileCache``: one per process, so every object is downloaded once however many restores
of the process need it (Flink's ``ChangelogStreamHandleReaderWithCache``, without its bugs).

Theory of operation
-------------------
An *entry* is one object of one store, named by ``(store.location, key)``. It moves through

    LOADING --publish--> READY --evict (TTL or budget)--> GONE
       |  \\--cannot fit, on_full="direct"--> DIRECT (no local file; ranged reads from the store)
       \\--any failure--> FAILED (removed from the map at once, so the next lease tries again)

*Single flight.* The first ``lease()`` of an absent object creates a LOADING entry under the map
lock and becomes the *owner*; later openers find the entry and wait on its ``done`` event. The
owner downloads, verifies, writes and publishes with no lock held; the map lock only guards
bookkeeping (counts, LRU order, budget reservations). Waiters of a failed flight raise the owner's
error; the failed entry is gone from the map, so nothing is poisoned.

*Download.* ``store.get`` -> the caller's ``verify(data, key)`` (segments: ``decode_segment``,
which checks every byte) -> a temp file ``.<name>.<pid>.<16 hex>.tmp`` in the cache directory ->
``fsync`` (a delayed-allocation ``ENOSPC``/``EIO`` surfaces here, before publication) -> atomic
``rename`` to a name that is unique per download (``<base>.<digest>.<token>.obj``), so unlinking an
evicted file can never race with a new download of the same object. Any failure removes the temp
file. Objects are kept as stored: every change set of a segment is its own zstd frame at a known
offset, so seeks are already O(1) and decompression happens per change set, once, in the reader.

*Leases.* A :class:`CacheLease` is a reference count with its own file descriptor (``os.pread``;
no shared file position). A file with open leases is never evicted. Releasing is idempotent
through the context manager, but an explicit second ``release()`` raises
:class:`~dstl.errors.LeaseError` (Flink's FLINK-30561 was a double close that deleted a file in
use), and so does any use after release. Every failure between taking a count and handing out the
lease gives the count back (apache/flink#27969: a failed seek after ``retain`` leaked it).

*Idle TTL.* When the last lease of a file is released, its eviction is scheduled ``idle_ttl_s``
later; a new lease cancels it. Each schedule carries a generation number that the callback checks,
so an earlier timer can never evict a file that was used since (Flink's quirk: earlier cleanups
were not cancelled, so a file could go ``idle-timeout`` after an *earlier* close).

*Budget.* With ``max_bytes``, the size is known before the download (``size_hint`` or ``head``)
and reserved; unleased files are evicted in least-recently-used order to make room (nothing is
evicted unless the object then fits). An object that cannot fit (everything leased, or larger than
the budget) or a full local disk (``ENOSPC``/``EFBIG``/``EDQUOT`` while writing) gives
:class:`~dstl.errors.CacheFullError` (chained to :class:`~dstl.errors.LocalDiskFullError` for the
disk), or with ``on_full="direct"`` a *direct* lease whose reads are ranged reads from the store.

*Prefetch.* :meth:`LocalFileCache.prefetch` queues the objects a restore is about to lease, in
its order; up to ``prefetch_threads`` threads (``dstl-prefetch``, started on demand, gone when
the queue is empty) take them in turn and run the same flight as a lease — a LOADING entry in the
map, so a lease of the object joins it like any waiter — except that a prefetch never evicts,
never serves direct reads and never raises: an object already cached or in flight is left alone;
one that does not fit in the free budget, or would take the prefetched-but-not-yet-leased bytes
beyond ``PREFETCH_BUDGET_SHARE`` of ``max_bytes``, is skipped; a failed download is forgotten
(the entry ends GONE, not FAILED, so a waiting lease downloads anew and raises its own error).
A published prefetch is an idle file (idle TTL scheduled, evictable; when the budget must make
room, idle files nobody asked for go first, then prefetched ones, furthest-needed first). A lease
that finds the budget held by prefetches in flight waits for them to publish (then they are
evictable) instead of raising ``CacheFullError``. ``cancel()`` of the returned
:class:`CachePrefetch` drops its queued objects and waits for its downloads in flight.

*Start and close* (:mod:`restore.cache_directory`). The directory is locked (``flock``) for the
cache's lifetime, so no two caches share it. Opening removes temp files of crashed processes and the published files of a previous
process: a fresh process starts empty (a file that nobody verified in this process is not
trusted). ``close()`` invalidates outstanding leases, waits for downloads in flight, deletes every
file, stops the timer it owns and removes the lock file (and the directory if it created it).

*Rooms.* :class:`LocalFileCache` composes the parts and keeps the leases and the flight (who
owns a download, who waits): the entries, budget and idle TTL are a
:class:`~restore.cache_book.CacheBook`, one download is a
:class:`~restore.cache_download.Downloader`, the prefetch queue and threads a
:class:`~restore.cache_prefetch.Prefetcher`, the directory a
:class:`~restore.cache_directory.CacheDirectory`; all share the book's lock.

*Fork.* The creating pid is recorded; any use from a forked child raises
:class:`~dstl.errors.CacheError` (a child must create its own cache in its own directory), and
``close()`` in a child does nothing (the files belong to the parent).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import cast

from dstl.checks import check_choice, check_int, check_number, check_optional_path
from dstl.errors import (
    CacheError,
    ClosedError,
    ConfigTypeError,
    DstlError,
    UsageError,
)
from dstl.stores.base import BlobStore, check_key
from dstl.timer import Timer, check_timer
from restore.cache_book import (
    CLOSE_WAIT_S,
    PREFETCH_BUDGET_SHARE,
    CacheBook,
    Entry,
    EntryState,
    Outcome,
)
from restore.cache_directory import CacheDirectory, unlink
from restore.cache_download import Downloader, OnFull
from restore.cache_prefetch import CachePrefetch, Prefetcher, prefetchable
from restore.lease import Lease
from restore.leasing import LeasingCache, PrefetchItem, Verify

__all__ = [
    "DEFAULT_IDLE_TTL_S",
    "DEFAULT_PREFETCH_THREADS",
    "PREFETCH_BUDGET_SHARE",
    "CacheLease",
    "CachePrefetch",
    "Lease",
    "LocalFileCache",
    "OnFull",
    "Verify",
]

logger = logging.getLogger(__name__)

#: Flink's ``dstl.dfs.download.local-cache.idle-timeout-ms`` default (10 min): long enough for the
#: restores of one recovery (all backends of a process restore at about the same time), short
#: enough that a cache does not keep a recovery's segments on disk for the job's lifetime.
DEFAULT_IDLE_TTL_S = 600.0
#: Longest idle TTL (a week): longer only keeps files; far longer would overflow the timer.
MAX_IDLE_TTL_S = 7 * 86_400.0
#: Downloads a cache's prefetches run at once: object-store latency, not bandwidth, is what a
#: restore waits for, and store I/O, zstd and crc release the GIL, so a few threads overlap it
#: with loading; more would only hold more objects in memory at once.
DEFAULT_PREFETCH_THREADS = 4


class CacheLease(Lease):
    """A lease of one object of a :class:`LocalFileCache` (see :class:`Lease`).

    Obtained from :meth:`LocalFileCache.lease`, never constructed directly.
    """

    _NEW_LEASE = "take a new lease with LocalFileCache.lease"

    def __init__(self, cache: LocalFileCache, entry: Entry | None, store: BlobStore,
                 key: str, size: int, path: str | None) -> None:
        super().__init__(store, key, size, path)
        self._cache = cache
        self._entry = entry

    def _check_pid(self) -> None:
        self._cache._check_pid()

    def _direct_read(self, offset: int, length: int) -> bytes:
        data = super()._direct_read(offset, length)
        self._cache._count_direct_read()
        return data

    def _on_released(self, *, explicit: bool) -> None:
        self._cache._on_release(self)

    def _closed_reason(self) -> str:
        return f"the cache {self._cache.directory} was closed, which invalidated the lease"

    def _attach(self) -> None:
        """Open the lease's file descriptor (outside the cache's lock)."""
        assert self.path is not None
        failure: OSError | None = None
        with self._lock:
            if self.released:
                raise ClosedError(f"LocalFileCache({self._cache.directory!r})")
            try:
                # O_NOFOLLOW: a cached file replaced by a link is refused, never followed.
                self._fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            except OSError as exc:
                failure = exc
        if failure is not None:
            self._release(explicit=False)  # give the count back (apache/flink#27969)
            if failure.errno == errno.ELOOP:
                raise CacheError(f"cached file {self.path} of {self.location}/{self.key} was "
                                 "replaced by a symbolic link, which the cache never follows; "
                                 "give the cache a directory of its own") from failure
            raise CacheError(f"cached file {self.path} of {self.location}/{self.key} cannot be "
                             f"opened ({failure}); was the cache directory changed by someone "
                             "else? Give the cache a directory of its own") from failure


def _checked_arguments(directory: object, idle_ttl_s: object, max_bytes: object,
                       timer: object, on_full: object, prefetch_threads: object
                       ) -> tuple[str, float, int | None, OnFull, int]:
    """The constructor's arguments, checked (one place): ``(absolute directory, idle TTL,
    byte budget, on_full)``.

    Raises:
        ConfigError: a value out of range (ConfigTypeError: a wrong type).
    """
    owner = "LocalFileCache"
    path = check_optional_path(directory, "directory", owner)
    if path is None:
        raise ConfigTypeError("directory", directory, "a non-empty path (str or os.PathLike)",
                              owner=owner)
    ttl = check_number(idle_ttl_s, "idle_ttl_s", owner, lo=0.0, hi=MAX_IDLE_TTL_S,
                       unit="seconds", fix="how long an unused file stays cached")
    budget = None if max_bytes is None else check_int(
        max_bytes, "max_bytes", owner, lo=1, fix="use None for no budget")
    check_timer(timer, "timer", owner)
    mode = check_choice(on_full, "on_full", owner, ("raise", "direct"))
    threads = check_int(prefetch_threads, "prefetch_threads", owner, lo=1, hi=64,
                        fix="downloads prefetches run at once")
    return os.path.abspath(path), ttl, budget, cast(OnFull, mode), threads


class LocalFileCache:
    """A per-process cache of whole objects on local disk (see the module docstring).

    Args:
        directory: where the files live; created if missing. Must belong to this cache alone
            (it is locked, and files of a previous process in it are deleted on open).
        idle_ttl_s: a file whose last lease was released is deleted this many seconds later,
            unless leased again (>= 0).
        max_bytes: size budget of the cached files (> 0), or ``None`` for no budget. With a
            budget, the size of an object is taken from ``size_hint`` or a ``head`` request before
            it is downloaded.
        timer: schedules the idle evictions (tests pass a ``ManualTimer``); by default the cache
            starts its own ``ThreadTimer`` (thread ``dstl-timer-cache``) when the first eviction
            is scheduled, and stops it on :meth:`close`.
        on_full: what a lease does when the object cannot be cached (budget exhausted by leased
            files, object larger than the budget, local disk full): ``"raise"``
            :class:`~dstl.errors.CacheFullError`, or ``"direct"``: hand out a lease that reads
            ranges straight from the store (no local file, no whole-object verification; the
            change-set reader still checks every record's CRC).
        prefetch_threads: downloads :meth:`prefetch` runs at once (1..64).

    Raises:
        ConfigError: an argument is out of range.
        CacheError: the directory is in use by another cache, or cannot be created or cleaned.
    """

    def __init__(self, directory: str | os.PathLike[str], idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
                 max_bytes: int | None = None, *, timer: Timer | None = None,
                 on_full: OnFull = "raise",
                 prefetch_threads: int = DEFAULT_PREFETCH_THREADS) -> None:
        (self.directory, self.idle_ttl_s, self.max_bytes, self.on_full,
         self.prefetch_threads) = _checked_arguments(directory, idle_ttl_s, max_bytes, timer,
                                                     on_full, prefetch_threads)
        self._pid = os.getpid()
        self._book = CacheBook(self.directory, self.idle_ttl_s, self.max_bytes, timer,
                               repr(self))
        self._cond = self._book.cond  # the map lock: bookkeeping only, never held for I/O
        self._leases: set[CacheLease] = set()
        self._downloader = Downloader(self._book, self.directory, self.on_full)
        self._prefetcher = Prefetcher(self._book, self._downloader, self.prefetch_threads,
                                      repr(self))
        self._dir = CacheDirectory(self.directory)
        try:
            temps, previous = self._dir.open()
        except OSError as exc:
            raise CacheError(f"restore cache directory {self.directory} cannot be used ({exc}); "
                             "choose a writable local directory") from exc
        logger.info("restore cache %s opened (max_bytes=%s, idle_ttl_s=%s, on_full=%s); removed "
                    "%d temp files of crashed processes (pids %s) and %d files of a previous "
                    "process", self.directory, self.max_bytes, self.idle_ttl_s, self.on_full,
                    len(temps), sorted(set(temps)), previous)

    def __repr__(self) -> str:
        return f"LocalFileCache({self.directory!r})"

    def __enter__(self) -> LocalFileCache:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ public API

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has started."""
        return self._book.closed

    def lease(self, store: BlobStore, key: str, *, verify: Verify | None = None,
              size_hint: int | None = None) -> CacheLease:
        """Lease the object ``key`` of ``store``, downloading it once per process if needed.

        Concurrent calls for the same ``(store.location, key)`` share one download (single
        flight); no lock is held while it runs.

        Args:
            store: where the object lives.
            key: the object key (validated: untrusted input).
            verify: ``verify(data, key)`` checks the downloaded bytes before they are published
                (segments: ``lambda d, k: decode_segment(d, k)``); an exception other than
                :class:`~dstl.errors.DstlError` is reported as a ``CorruptObjectError``.
            size_hint: the object's size if known (saves a ``head`` when a budget is set).

        Returns:
            A :class:`CacheLease`; use it as a context manager.

        Raises:
            ObjectNotFoundError: the object does not exist.
            CorruptObjectError: ``verify`` rejected the bytes (nothing is cached; the next lease
                downloads again).
            CacheFullError: the object cannot be cached and ``on_full="raise"`` (names the sizes
                and the setting; chained to ``LocalDiskFullError`` when the disk is full).
            StorageError: the download failed (after the store's own read retries).
            ClosedError: the cache is closed.
            CacheError: used in a forked child, or the cache file cannot be written.
            UnsafePathError: the key is not allowed.
        """
        self._check_pid()
        check_key(key)
        if size_hint is not None and (isinstance(size_hint, bool) or not isinstance(size_hint, int)
                                      or size_hint < 0):
            raise UsageError(f"lease of {store.location}/{key}: size_hint={size_hint!r} is not "
                             "None or an integer >= 0")
        ident = (store.location, key)
        while True:
            entry, owner, lease = self._enter(ident, store)
            if owner:
                return self._fly(entry, store, key, verify, size_hint)
            if lease is not None:
                lease._attach()
                return lease
            lease = self._await_flight(entry, store, key)
            if lease is not None:
                return lease
            # READY (take a lease on the next turn) or already GONE again (download anew)

    def prefetch(self, store: BlobStore, objects: Sequence[PrefetchItem]) -> CachePrefetch:
        """Start downloading ``objects`` of ``store`` in the background, first first, on up to
        ``prefetch_threads`` threads (see the module docstring); a later :meth:`lease` of one of
        them joins its download or finds its file.

        Never raises for an object: a repeated object is queued once, a key that
        :meth:`lease` would refuse or a bad size hint is left to the lease (which raises as
        it does without a prefetch), an object already cached or in flight is left alone, one
        that does not fit is skipped, a failed download is forgotten.

        Args:
            store: where the objects live.
            objects: what the leases will ask for, in the order they will.

        Returns:
            A :class:`CachePrefetch`; its ``cancel()`` drops what has not started.

        Raises:
            ClosedError: the cache is closed.
            CacheError: used in a forked child.
            UsageError: ``objects`` holds something that is not a ``PrefetchItem``.
        """
        self._check_pid()
        items: dict[str, PrefetchItem] = {}
        for item in objects:
            if not isinstance(item, PrefetchItem):
                raise UsageError(f"{self!r}.prefetch: {item!r} is not a restore.PrefetchItem")
            if item.key not in items and prefetchable(item):
                items[item.key] = item
        return self._prefetcher.submit(store, items.values())

    def stats(self) -> dict[str, int]:
        """Counters and gauges (a consistent snapshot).

        Returns:
            ``downloads`` (whole objects fetched), ``hits`` (leases served without a download of
            their own, including waiters of another's download), ``waits`` (leases that waited
            for a download in flight), ``bytes_downloaded``, ``download_failures``,
            ``leases_open``, ``files``, ``bytes_cached``, ``bytes_reserved`` (downloads in
            flight), ``downloads_in_flight``, ``evictions`` (= ``evictions_ttl`` +
            ``evictions_budget`` + ``evictions_disk_full``), ``direct_leases``, ``direct_reads``;
            of :meth:`prefetch`: ``prefetch_started`` (GETs a prefetch began; also counted in
            ``downloads`` once they returned), ``prefetch_joined`` (prefetched objects a
            lease then took: joined the download or found the file), ``prefetch_present``
            (already cached or in flight: nothing to do), ``prefetch_skipped`` (did not fit the
            free budget or the prefetch share of it, or the disk), ``prefetch_failed``
            (forgotten; the lease downloads again), ``prefetch_cancelled`` (dropped from the queue
            unstarted), ``prefetch_evicted`` (prefetched files evicted before any lease took
            them), and the gauges ``prefetch_queued`` and ``bytes_prefetched`` (prefetched
            bytes no lease has taken yet, in flight or cached).

        Raises:
            CacheError: called in a forked child.
        """
        self._check_pid()
        with self._cond:
            return self._stats()

    def wait_for_stats(self, predicate: Callable[[dict[str, int]], bool],
                       timeout_s: float = 10.0) -> dict[str, int]:
        """Block until ``predicate(stats())`` holds (tests and tools; never polls).

        Returns:
            The stats that satisfied the predicate.

        Raises:
            TimeoutError: not within ``timeout_s``.
        """
        self._check_pid()
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self._stats()), timeout_s):
                raise TimeoutError(f"{self!r}: stats did not reach the expected state within "
                                   f"{timeout_s}s; now {self._stats()}")
            return self._stats()

    def close(self) -> None:
        """Invalidate outstanding leases, delete every file, stop the timer it owns.

        Idempotent. Downloads in flight are waited for (up to 30 s) and clean up after themselves.
        In a forked child this does nothing: the files belong to the parent.
        """
        if os.getpid() != self._pid:
            logger.debug("%r: close() in forked child %d ignored (the parent owns the files)",
                         self, os.getpid())
            return
        taken = self._take_everything()
        if taken is None:
            return  # closed already
        leases, entries, threads = taken
        for lease in leases:
            lease.invalidate()
        self._wait_for_downloads(entries)
        for t in threads:  # they saw the cache closed; their downloads just ended
            t.join(CLOSE_WAIT_S)
        removed = sum(unlink(e.path) for e in entries
                      if e.state is EntryState.READY and e.path is not None)
        self._book.close_timer()
        self._dir.close()
        with self._cond:
            st = self._stats()
        if leases:
            logger.warning("%r closed with %d leases still open (invalidated)", self, len(leases))
        logger.info("restore cache %s closed: %d files deleted, %d downloads (%d bytes), %d hits, "
                    "%d evictions", self.directory, removed, st["downloads"],
                    st["bytes_downloaded"], st["hits"], st["evictions"])

    def _take_everything(self) -> tuple[list[CacheLease], list[Entry],
                                        list[threading.Thread]] | None:
        """Mark the cache closed, empty its maps and its prefetch queue (``None``: it was closed
        already); also returns the prefetch threads, to be joined."""
        with self._cond:
            if self._book.closed:
                return None
            entries = self._book.take_everything_locked()
            threads = self._prefetcher.drop_everything_locked()
            leases = list(self._leases)
            self._leases.clear()
            self._cond.notify_all()
        return leases, entries, threads

    def _wait_for_downloads(self, entries: list[Entry]) -> None:
        for e in entries:
            if e.state is EntryState.LOADING and not e.done.wait(CLOSE_WAIT_S):
                logger.warning("%r: download of %s still running at close; it removes its temp "
                               "file when it ends", self, e.key)

    # ------------------------------------------------------------------ the flight

    def _enter(self, ident: tuple[str, str], store: BlobStore
               ) -> tuple[Entry, bool, CacheLease | None]:
        """Under the map lock: create the entry and own its flight (``True``), lease a READY
        entry (the lease, to be attached outside the lock), or join a flight in progress."""
        owner = False
        lease: CacheLease | None = None
        with self._cond:
            self._book.check_open_locked()
            entry = self._book.entries.get(ident)
            if entry is None:
                entry = Entry(ident)
                self._book.entries[ident] = entry
                owner = True
            elif entry.state is EntryState.READY:
                lease = self._retain(entry, store)
                self._book.counts["hits"] += 1
            else:
                self._book.counts["waits"] += 1
            self._cond.notify_all()
        return entry, owner, lease

    def _await_flight(self, entry: Entry, store: BlobStore, key: str) -> CacheLease | None:
        """A waiter's part: the owner's error, a direct lease, or ``None`` (lease anew)."""
        entry.done.wait()
        if entry.state is EntryState.FAILED:
            err = entry.error
            if isinstance(err, DstlError):
                raise err
            raise CacheError(f"download of {store.location}/{key} failed in another thread "
                             f"({err!r})") from err
        if entry.state is EntryState.DIRECT:
            return self._direct_lease(store, key, entry.size)
        return None

    def _fly(self, entry: Entry, store: BlobStore, key: str, verify: Verify | None,
             size_hint: int | None) -> CacheLease:
        """The owner's part: fetch, publish, wake the waiters (no lock held during I/O)."""
        outcome: Outcome | None = None
        try:
            outcome = self._downloader.fetch(entry, store, key, verify, size_hint)
            with self._cond:
                if self._book.closed:
                    raise ClosedError(repr(self))
                self._book.publish_locked(entry, outcome)
                if outcome.path is None:
                    lease = self._register_direct(store, key, outcome.size)
                else:
                    lease = self._retain(entry, store)
                self._cond.notify_all()
        except BaseException as exc:
            # downloaded, but the cache closed meanwhile: the file goes too
            self._book.end_flight(entry, outcome, EntryState.FAILED, "download_failures", exc)
            logger.warning("restore cache: lease of %s/%s failed, nothing cached: %s",
                           store.location, key, exc)
            raise
        entry.done.set()
        if outcome.path is not None:
            lease._attach()
            logger.debug("restore cache: downloaded %s/%s (%d bytes) to %s", store.location, key,
                         outcome.size, outcome.path)
        return lease

    # ------------------------------------------------------------------ leases (lock held)

    def _retain(self, entry: Entry, store: BlobStore) -> CacheLease:
        self._book.retain_locked(entry)
        assert entry.path is not None
        lease = CacheLease(self, entry, store, entry.key, entry.size, entry.path)
        self._leases.add(lease)
        return lease

    def _register_direct(self, store: BlobStore, key: str, size: int) -> CacheLease:
        lease = CacheLease(self, None, store, key, size, None)
        self._leases.add(lease)
        self._book.counts["direct_leases"] += 1
        return lease

    def _on_release(self, lease: CacheLease) -> None:
        with self._cond:
            if lease not in self._leases:
                return  # invalidated by close()
            self._leases.discard(lease)
            entry = lease._entry
            if entry is not None:
                self._book.release_locked(entry)
            self._cond.notify_all()

    def _direct_lease(self, store: BlobStore, key: str, size: int) -> CacheLease:
        with self._cond:
            self._book.check_open_locked()
            lease = self._register_direct(store, key, size)
            self._cond.notify_all()
            return lease

    def _count_direct_read(self) -> None:
        with self._cond:
            self._book.counts["direct_reads"] += 1

    def _stats(self) -> dict[str, int]:
        book = self._book.stats_locked()
        out = {k: book[k] for k in self._book.counts}
        out.update(
            leases_open=len(self._leases),
            files=book["files"],
            bytes_cached=book["bytes_cached"],
            bytes_reserved=book["bytes_reserved"],
            downloads_in_flight=book["downloads_in_flight"],
            evictions=book["evictions"],
            prefetch_queued=self._prefetcher.queued_locked(),
            bytes_prefetched=book["bytes_prefetched"],
        )
        return out

    def _check_pid(self) -> None:
        pid = os.getpid()
        if pid != self._pid:
            raise CacheError(f"{self!r} was created in process {self._pid} and used in forked "
                             f"process {pid}; create a new LocalFileCache, in a directory of its "
                             "own, in each process (never share one across fork)")


#: mypy proves here that the local cache is a :class:`~restore.leasing.LeasingCache` (the seam
#: ChangelogReader and restore_backend take).
_LOCAL_CACHE_IS_LEASING: type[LeasingCache] = LocalFileCache
