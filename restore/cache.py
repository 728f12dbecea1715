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

*Fork.* The creating pid is recorded; any use from a forked child raises
:class:`~dstl.errors.CacheError` (a child must create its own cache in its own directory), and
``close()`` in a child does nothing (the files belong to the parent).
"""

from __future__ import annotations

import enum
import errno
import functools
import logging
import os
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, cast

from dstl.checks import check_choice, check_int, check_number, check_optional_path
from dstl.errors import (
    CacheError,
    CacheFullError,
    ClosedError,
    ConfigTypeError,
    CorruptObjectError,
    DstlError,
    LocalDiskFullError,
    ObjectNotFoundError,
    TruncatedObjectError,
    UsageError,
)
from dstl.stores.base import BlobStore, check_key
from dstl.stores.local import write_new_file_durably
from dstl.timer import ThreadTimer, Timer, TimerHandle, check_timer
from restore.cache_directory import CacheDirectory, published_name, temp_name, unlink
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
#: How long ``close()`` waits for downloads in flight to finish and clean up their temp files.
_CLOSE_WAIT_S = 30.0
#: Downloads a cache's prefetches run at once: object-store latency, not bandwidth, is what a
#: restore waits for, and store I/O, zstd and crc release the GIL, so a few threads overlap it
#: with loading; more would only hold more objects in memory at once.
DEFAULT_PREFETCH_THREADS = 4
#: The share of ``max_bytes`` that prefetched objects no lease has taken yet may hold: the rest
#: stays for the leases (a prefetch never evicts anything to make room).
PREFETCH_BUDGET_SHARE = 0.5

OnFull = Literal["raise", "direct"]

_DISK_FULL_ERRNOS = {
    errno.ENOSPC: "the local disk is full (ENOSPC)",
    errno.EDQUOT: "the disk quota is exhausted (EDQUOT)",
    errno.EFBIG: "the file is larger than the filesystem or the process's RLIMIT_FSIZE allows "
                 "(EFBIG)",
}
_DISK_FULL_RETRY_ERRNOS = {errno.ENOSPC, errno.EDQUOT}  # evicting idle files can help these
#: The prefetch counters of :meth:`LocalFileCache.stats`.
_PREFETCH_COUNTS = ("prefetch_started", "prefetch_joined", "prefetch_present", "prefetch_skipped",
                    "prefetch_failed", "prefetch_cancelled", "prefetch_evicted")


class _State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DIRECT = "direct"
    FAILED = "failed"
    GONE = "gone"


class _Entry:
    """One object of one store in the cache (all fields guarded by the cache's lock)."""

    __slots__ = ("done", "error", "ident", "key", "leases", "path", "prefetched", "reserved",
                 "size", "state", "ttl", "ttl_gen")

    def __init__(self, ident: tuple[str, str]) -> None:
        self.ident = ident
        self.key = ident[1]
        self.state = _State.LOADING
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.path: str | None = None
        self.size = 0
        self.reserved = 0  # budget bytes held while LOADING
        self.leases = 0
        self.ttl: TimerHandle | None = None
        self.ttl_gen = 0
        self.prefetched = False  # downloaded by a prefetch, not leased yet


class _Skipped(Exception):
    """A prefetch that does not fit (budget, disk): skipped, never an error."""


class CachePrefetch:
    """The ticket of one :meth:`LocalFileCache.prefetch` call (a
    :class:`~restore.leasing.PrefetchTicket`); its counts are guarded by the cache's lock."""

    __slots__ = ("_cache", "queued", "running")

    def __init__(self, cache: LocalFileCache) -> None:
        self._cache = cache
        self.queued = 0  # objects in the cache's queue
        self.running = 0  # objects a prefetch thread works on

    def cancel(self, *, wait: bool = True) -> None:
        """Drop the objects not started yet; with ``wait``, wait (up to 30 s) for the ones in
        flight and for the threads that ran them to end. Idempotent, never raises."""
        self._cache._cancel(self, wait)


@dataclass(frozen=True, slots=True)
class _Job:
    ticket: CachePrefetch
    store: BlobStore
    item: PrefetchItem


@dataclass(frozen=True, slots=True)
class _Outcome:
    path: str | None  # None: serve direct ranged reads
    size: int


class CacheLease(Lease):
    """A lease of one object of a :class:`LocalFileCache` (see :class:`Lease`).

    Obtained from :meth:`LocalFileCache.lease`, never constructed directly.
    """

    _NEW_LEASE = "take a new lease with LocalFileCache.lease"

    def __init__(self, cache: LocalFileCache, entry: _Entry | None, store: BlobStore,
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
        self._timer: Timer | None = timer
        self._own_timer = timer is None
        self._cond = threading.Condition()  # the map lock: bookkeeping only, never held for I/O
        self._entries: dict[tuple[str, str], _Entry] = {}
        self._lru: OrderedDict[tuple[str, str], _Entry] = OrderedDict()  # READY, oldest first
        self._leases: set[CacheLease] = set()
        self._closed = False
        self._bytes_cached = 0
        self._bytes_reserved = 0
        self._counts = dict.fromkeys(
            ("downloads", "hits", "waits", "bytes_downloaded", "download_failures",
             "evictions_ttl", "evictions_budget", "evictions_disk_full", "direct_leases",
             "direct_reads", *_PREFETCH_COUNTS), 0)
        self._queue: deque[_Job] = deque()  # prefetches not started yet, first needed first
        self._workers: set[threading.Thread] = set()  # prefetch threads running
        self._retired: list[threading.Thread] = []  # prefetch threads that ended (to be joined)
        # prefetch threads started that have not taken their first turn (cancel waits for them)
        self._fresh: set[threading.Thread] = set()
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
        return self._closed

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
            if item.key not in items and _prefetchable(item):
                items[item.key] = item
        ticket = CachePrefetch(self)
        with self._cond:
            self._check_open()
            self._queue.extend(_Job(ticket, store, item) for item in items.values())
            ticket.queued = len(items)
            # threads nobody joined (cancel without waiting: the agent's) are forgotten here
            self._retired = [t for t in self._retired if t.is_alive()]
            for _ in range(min(self.prefetch_threads - len(self._workers), len(self._queue))):
                t = threading.Thread(target=self._prefetch_worker, name="dstl-prefetch",
                                     daemon=True)
                self._workers.add(t)
                self._fresh.add(t)
                t.start()
            self._cond.notify_all()
        return ticket

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
            t.join(_CLOSE_WAIT_S)
        removed = sum(unlink(e.path) for e in entries
                      if e.state is _State.READY and e.path is not None)
        if self._own_timer and self._timer is not None:
            self._timer.close()
        self._dir.close()
        with self._cond:
            st = self._stats()
        if leases:
            logger.warning("%r closed with %d leases still open (invalidated)", self, len(leases))
        logger.info("restore cache %s closed: %d files deleted, %d downloads (%d bytes), %d hits, "
                    "%d evictions", self.directory, removed, st["downloads"],
                    st["bytes_downloaded"], st["hits"], st["evictions"])

    def _take_everything(self) -> tuple[list[CacheLease], list[_Entry],
                                        list[threading.Thread]] | None:
        """Mark the cache closed, empty its maps and its prefetch queue (``None``: it was closed
        already); also returns the prefetch threads, to be joined."""
        with self._cond:
            if self._closed:
                return None
            self._closed = True
            for job in self._queue:
                job.ticket.queued -= 1
            self._counts["prefetch_cancelled"] += len(self._queue)
            self._queue.clear()
            threads = [*self._workers, *self._retired]
            self._retired.clear()
            leases = list(self._leases)
            self._leases.clear()
            entries = list(self._entries.values())
            self._entries.clear()
            self._lru.clear()
            for e in entries:
                self._cancel_ttl(e)
            self._cond.notify_all()
        return leases, entries, threads

    def _wait_for_downloads(self, entries: list[_Entry]) -> None:
        for e in entries:
            if e.state is _State.LOADING and not e.done.wait(_CLOSE_WAIT_S):
                logger.warning("%r: download of %s still running at close; it removes its temp "
                               "file when it ends", self, e.key)

    # ------------------------------------------------------------------ start-up

    # ------------------------------------------------------------------ the flight

    def _enter(self, ident: tuple[str, str], store: BlobStore
               ) -> tuple[_Entry, bool, CacheLease | None]:
        """Under the map lock: create the entry and own its flight (``True``), lease a READY
        entry (the lease, to be attached outside the lock), or join a flight in progress."""
        owner = False
        lease: CacheLease | None = None
        with self._cond:
            self._check_open()
            entry = self._entries.get(ident)
            if entry is None:
                entry = _Entry(ident)
                self._entries[ident] = entry
                owner = True
            elif entry.state is _State.READY:
                lease = self._retain(entry, store)
                self._counts["hits"] += 1
            else:
                self._counts["waits"] += 1
            self._cond.notify_all()
        return entry, owner, lease

    def _await_flight(self, entry: _Entry, store: BlobStore, key: str) -> CacheLease | None:
        """A waiter's part: the owner's error, a direct lease, or ``None`` (lease anew)."""
        entry.done.wait()
        if entry.state is _State.FAILED:
            err = entry.error
            if isinstance(err, DstlError):
                raise err
            raise CacheError(f"download of {store.location}/{key} failed in another thread "
                             f"({err!r})") from err
        if entry.state is _State.DIRECT:
            return self._direct_lease(store, key, entry.size)
        return None

    def _fly(self, entry: _Entry, store: BlobStore, key: str, verify: Verify | None,
             size_hint: int | None) -> CacheLease:
        """The owner's part: fetch, publish, wake the waiters (no lock held during I/O)."""
        outcome: _Outcome | None = None
        try:
            outcome = self._fetch(entry, store, key, verify, size_hint)
            with self._cond:
                if self._closed:
                    raise ClosedError(repr(self))
                self._bytes_reserved -= entry.reserved
                entry.reserved = 0
                entry.size = outcome.size
                if outcome.path is None:
                    entry.state = _State.DIRECT
                    del self._entries[entry.ident]
                    lease = self._register_direct(store, key, outcome.size)
                else:
                    entry.state = _State.READY
                    entry.path = outcome.path
                    self._bytes_cached += outcome.size
                    self._lru[entry.ident] = entry
                    lease = self._retain(entry, store)
                self._cond.notify_all()
        except BaseException as exc:
            # downloaded, but the cache closed meanwhile: the file goes too
            self._end_flight(entry, outcome, _State.FAILED, "download_failures", exc)
            logger.warning("restore cache: lease of %s/%s failed, nothing cached: %s",
                           store.location, key, exc)
            raise
        entry.done.set()
        if outcome.path is not None:
            lease._attach()
            logger.debug("restore cache: downloaded %s/%s (%d bytes) to %s", store.location, key,
                         outcome.size, outcome.path)
        return lease

    # ------------------------------------------------------------------ prefetch

    def _prefetch_worker(self) -> None:
        """A ``dstl-prefetch`` thread: take queued objects until the queue is empty."""
        me = threading.current_thread()
        finished: CachePrefetch | None = None
        while True:
            with self._cond:
                self._fresh.discard(me)
                if finished is not None:
                    finished.running -= 1  # in the same turn as retiring: cancel() can join us
                if self._closed or not self._queue:
                    self._workers.discard(me)
                    self._retired.append(me)
                    self._cond.notify_all()
                    return
                job = self._queue.popleft()
                job.ticket.queued -= 1
                job.ticket.running += 1
                self._cond.notify_all()
            finished = job.ticket
            try:
                self._prefetch_one(job.store, job.item)
            except Exception as exc:  # a bug here must not kill the thread or the restore
                logger.error("restore cache: prefetch of %s/%s failed unexpectedly",
                             job.store.location, job.item.key, exc_info=exc)

    def _prefetch_one(self, store: BlobStore, item: PrefetchItem) -> None:
        """Own the flight of ``item`` unless it is cached, in flight or cannot fit."""
        ident = (store.location, item.key)
        with self._cond:
            if self._closed:
                return
            if ident in self._entries:
                self._counts["prefetch_present"] += 1
                return
            entry = _Entry(ident)
            entry.prefetched = True
            if self.max_bytes is not None and item.size_hint is not None:
                # checked and reserved in one turn, so concurrent prefetches cannot overshoot
                if not self._prefetch_fits(item.size_hint):
                    self._counts["prefetch_skipped"] += 1
                    return
                entry.reserved = item.size_hint
                self._bytes_reserved += item.size_hint
            self._entries[ident] = entry
            self._cond.notify_all()
        self._fly_prefetch(entry, store, item)

    def _fly_prefetch(self, entry: _Entry, store: BlobStore, item: PrefetchItem) -> None:
        """A prefetch's flight: publish an idle file, or end GONE (leases waiting on it then
        download anew)."""
        outcome: _Outcome | None = None
        try:
            outcome = self._fetch(entry, store, item.key, item.verify, item.size_hint,
                                  prefetch=True)
            assert outcome.path is not None  # a prefetch never serves direct reads
            with self._cond:
                self._check_open()
                self._bytes_reserved -= entry.reserved
                entry.reserved = 0
                entry.size = outcome.size
                entry.state = _State.READY
                entry.path = outcome.path
                self._bytes_cached += outcome.size
                self._lru[entry.ident] = entry
                self._schedule_expiry(entry)  # idle until leased: evictable like any idle file
                self._cond.notify_all()
        except _Skipped as why:
            self._forget(entry, outcome, "prefetch_skipped")
            logger.debug("restore cache: prefetch of %s/%s skipped: %s", store.location,
                         item.key, why)
        except Exception as exc:  # noqa: BLE001 - forgotten, counted, logged; the lease retries
            self._forget(entry, outcome, "prefetch_failed")
            logger.info("restore cache: prefetch of %s/%s failed, forgotten (a lease downloads "
                        "it again): %s", store.location, item.key, exc)
        except BaseException:
            self._forget(entry, outcome, "prefetch_failed")
            raise
        entry.done.set()

    def _forget(self, entry: _Entry, outcome: _Outcome | None, counter: str) -> None:
        """End a prefetch's flight with nothing cached (GONE, not FAILED: a lease waiting on it
        downloads anew, so it raises its own error, not the prefetch's)."""
        self._end_flight(entry, outcome, _State.GONE, counter)

    def _end_flight(self, entry: _Entry, outcome: _Outcome | None, state: _State, counter: str,
                    error: BaseException | None = None) -> None:
        """End a flight with nothing cached: its file (if any) removed, its entry out of the
        map, its reservation given back, ``state`` (FAILED with ``error``, or GONE) set and
        the waiters woken."""
        if outcome is not None and outcome.path is not None:
            unlink(outcome.path)
        with self._cond:
            if self._entries.get(entry.ident) is entry:
                del self._entries[entry.ident]
            self._bytes_reserved -= entry.reserved
            entry.reserved = 0
            entry.state = state
            if error is not None:
                entry.error = error
            self._counts[counter] += 1
            self._cond.notify_all()
        entry.done.set()

    def _cancel(self, ticket: CachePrefetch, wait: bool) -> None:
        if os.getpid() != self._pid:
            return
        with self._cond:
            if ticket.queued:
                kept = deque(j for j in self._queue if j.ticket is not ticket)
                self._counts["prefetch_cancelled"] += len(self._queue) - len(kept)
                self._queue = kept
                ticket.queued = 0
                self._cond.notify_all()
            if not wait:
                return
            # its downloads, and threads not yet in their loop: with the queue empty such a
            # thread holds no download but would retire only after this returned
            if not self._cond.wait_for(
                    lambda: ticket.running == 0 and (bool(self._queue) or not self._fresh),
                    _CLOSE_WAIT_S):
                logger.warning("%r: prefetch downloads still running after %.0f s; they end on "
                               "their own", self, _CLOSE_WAIT_S)
            retired, self._retired = self._retired, []
        for t in retired:
            t.join(_CLOSE_WAIT_S)

    def _prefetch_fits(self, size: int) -> bool:
        """Whether a prefetch of ``size`` bytes fits the free budget and the prefetch share
        (lock held; a prefetch never evicts)."""
        assert self.max_bytes is not None
        free = self.max_bytes - self._bytes_cached - self._bytes_reserved
        prefetched = self._prefetched_bytes()
        return size <= free and prefetched + size <= self.max_bytes * PREFETCH_BUDGET_SHARE

    def _prefetched_bytes(self) -> int:
        """Bytes of prefetches no lease has taken yet: reserved in flight, or cached."""
        return (sum(e.reserved for e in self._entries.values()
                    if e.prefetched and e.state is _State.LOADING)
                + sum(e.size for e in self._lru.values() if e.prefetched))

    # ------------------------------------------------------------------ download

    def _fetch(self, entry: _Entry, store: BlobStore, key: str, verify: Verify | None,
               size_hint: int | None, *, prefetch: bool = False) -> _Outcome:
        exact = False
        size = size_hint
        if self.max_bytes is not None:
            if size is None:
                size, exact = self._head(store, key), True
            if not self._reserve(entry, size, prefetch=prefetch):
                return self._cannot_fit(store, key, size, exact, self._budget_message(key, size),
                                        prefetch=prefetch)
        if prefetch:
            with self._cond:
                self._counts["prefetch_started"] += 1
        data = store.get(key)
        with self._cond:
            self._counts["downloads"] += 1
            self._counts["bytes_downloaded"] += len(data)
            self._cond.notify_all()
        if exact and size is not None and len(data) != size:
            raise TruncatedObjectError(key, min(len(data), size), size, len(data),
                                       "download (size differs from head)")
        if self.max_bytes is not None and len(data) != entry.reserved \
                and not self._reserve(entry, len(data), prefetch=prefetch):
            return self._cannot_fit(store, key, len(data), True,
                                    self._budget_message(key, len(data)), prefetch=prefetch)
        if verify is not None:
            _run_verify(verify, data, key)
        try:
            path = self._write_file(store.location, key, data)
        except LocalDiskFullError as full:
            if prefetch:  # evicting to make room is the lease's call, not a hint's
                raise _Skipped(f"{full}") from full
            if getattr(full.__cause__, "errno", None) in _DISK_FULL_RETRY_ERRNOS \
                    and self._evict_idle():
                try:
                    path = self._write_file(store.location, key, data)
                except LocalDiskFullError as again:
                    full = again
                else:
                    return _Outcome(path, len(data))
            return self._cannot_fit(store, key, len(data), True, f"{full}", full,
                                    hint="free space on that disk, give the cache a directory "
                                         "on a larger disk or a max_bytes below the free space")
        return _Outcome(path, len(data))

    def _head(self, store: BlobStore, key: str) -> int:
        info = store.head(key)
        if info is None:
            raise ObjectNotFoundError(f"lease {store.location}/{key}: object not found", key=key)
        return info.size

    def _cannot_fit(self, store: BlobStore, key: str, size: int, exact: bool, message: str,
                    cause: BaseException | None = None, *,
                    hint: str = "raise LocalFileCache(max_bytes=...)",
                    prefetch: bool = False) -> _Outcome:
        if prefetch:
            raise _Skipped(message) from cause
        if self.on_full == "raise":
            raise CacheFullError(f"{message}; {hint}, or pass on_full='direct' to read such "
                                 "objects with ranged reads from the store") from cause
        if not exact:
            size = self._head(store, key)  # a direct lease needs the real size, not a hint
        logger.warning("restore cache: %s; serving it with direct ranged reads", message)
        return _Outcome(None, size)

    def _budget_message(self, key: str, size: int) -> str:
        assert self.max_bytes is not None
        with self._cond:
            leased = sum(e.size for e in self._lru.values() if e.leases)
            reserved = self._bytes_reserved
        if size > self.max_bytes:
            return (f"object {key} ({size} bytes) is larger than the restore cache budget "
                    f"max_bytes={self.max_bytes} of {self.directory}")
        return (f"object {key} ({size} bytes) does not fit in the restore cache budget "
                f"max_bytes={self.max_bytes} of {self.directory}: {leased} bytes are held by "
                f"open leases and {reserved} reserved by downloads in flight")

    def _write_file(self, location: str, key: str, data: bytes) -> str:
        """Temp file, fsync, atomic rename; the temp file is removed on any failure."""
        name = published_name(location, key)
        final = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, temp_name(name))
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
                    f"cannot cache {location}/{key} ({len(data)} bytes) in {self.directory}: "
                    f"{what} while writing {tmp}", key=key, path=tmp) from exc
            raise CacheError(f"cannot write the cache file of {location}/{key} in "
                             f"{self.directory} ({exc}); check the local disk") from exc
        return final

    # ------------------------------------------------------------------ bookkeeping (lock held)

    def _retain(self, entry: _Entry, store: BlobStore) -> CacheLease:
        self._cancel_ttl(entry)
        if entry.prefetched:
            entry.prefetched = False
            self._counts["prefetch_joined"] += 1
        entry.leases += 1
        self._lru.move_to_end(entry.ident)
        assert entry.path is not None
        lease = CacheLease(self, entry, store, entry.key, entry.size, entry.path)
        self._leases.add(lease)
        return lease

    def _register_direct(self, store: BlobStore, key: str, size: int) -> CacheLease:
        lease = CacheLease(self, None, store, key, size, None)
        self._leases.add(lease)
        self._counts["direct_leases"] += 1
        return lease

    def _cancel_ttl(self, entry: _Entry) -> None:
        entry.ttl_gen += 1  # a callback that already fired but has not run yet sees a new gen
        if entry.ttl is not None:
            entry.ttl.cancel()
            entry.ttl = None

    def _reserve(self, entry: _Entry, size: int, *, prefetch: bool = False) -> bool:
        """Reserve ``size`` budget bytes for ``entry``: a lease evicts idle files (those nobody
        asked for first, in LRU order, then prefetched ones, furthest-needed first) and waits
        for prefetches in flight that hold the room it needs; a prefetch takes free room only."""
        assert self.max_bytes is not None
        victims: list[str] = []
        idle: list[_Entry] = []
        used = 0
        with self._cond:
            while True:
                self._check_open()
                self._bytes_reserved -= entry.reserved
                entry.reserved = 0
                if prefetch:
                    if not self._prefetch_fits(size):
                        return False
                    break
                used = self._bytes_cached + self._bytes_reserved
                idle = [e for e in self._lru.values() if not e.leases]
                evictable = sum(e.size for e in idle)
                flying = sum(e.reserved for e in self._entries.values()
                             if e.prefetched and e.state is _State.LOADING)
                if size > self.max_bytes or used - evictable - flying + size > self.max_bytes:
                    return False  # evicting would not help: evict nothing
                if used - evictable + size <= self.max_bytes:
                    break
                # prefetches in flight hold the room: once published they are idle, evictable
                self._cond.wait(_CLOSE_WAIT_S)
            # idle is empty for a prefetch: it never evicts
            for e in [*(e for e in idle if not e.prefetched),
                      *(e for e in reversed(idle) if e.prefetched)]:
                if used + size <= self.max_bytes:
                    break
                used -= e.size
                victims.append(self._remove(e, "evictions_budget"))
            entry.reserved = size
            self._bytes_reserved += size
            self._cond.notify_all()
        for path in victims:
            unlink(path)
        if victims:
            logger.debug("restore cache %s: evicted %d idle files (LRU) to fit %s (%d bytes)",
                         self.directory, len(victims), entry.key, size)
        return True

    def _evict_idle(self) -> int:
        """Evict every unleased file (the disk is full); return how many."""
        with self._cond:
            victims = [self._remove(e, "evictions_disk_full")
                       for e in list(self._lru.values()) if not e.leases]
            self._cond.notify_all()
        for path in victims:
            unlink(path)
        if victims:
            logger.warning("restore cache %s: local disk full, evicted %d idle files",
                           self.directory, len(victims))
        return len(victims)

    def _remove(self, entry: _Entry, counter: str) -> str:
        """Forget a READY entry without leases; return its path (the caller unlinks it)."""
        if self._entries.get(entry.ident) is entry:
            del self._entries[entry.ident]
        self._lru.pop(entry.ident, None)
        self._cancel_ttl(entry)
        self._bytes_cached -= entry.size
        entry.state = _State.GONE
        self._counts[counter] += 1
        if entry.prefetched:
            self._counts["prefetch_evicted"] += 1
        assert entry.path is not None
        return entry.path

    def _on_release(self, lease: CacheLease) -> None:
        with self._cond:
            if lease not in self._leases:
                return  # invalidated by close()
            self._leases.discard(lease)
            entry = lease._entry
            if entry is not None:
                entry.leases -= 1
                if entry.leases == 0 and entry.state is _State.READY and not self._closed:
                    self._lru.move_to_end(entry.ident)
                    self._schedule_expiry(entry)
            self._cond.notify_all()

    def _schedule_expiry(self, entry: _Entry) -> None:
        self._cancel_ttl(entry)
        if self._timer is None:
            self._timer = ThreadTimer("cache")
        entry.ttl = self._timer.schedule(self.idle_ttl_s,
                                         functools.partial(self._expire, entry, entry.ttl_gen))

    def _expire(self, entry: _Entry, gen: int) -> None:
        if os.getpid() != self._pid:
            return
        with self._cond:
            # The generation check is the fix of Flink's quirk: a timer scheduled before the
            # file's last use never evicts it, even if its cancel() raced with its firing.
            if self._closed or entry.state is not _State.READY or entry.leases \
                    or entry.ttl_gen != gen:
                return
            entry.ttl = None
            path = self._remove(entry, "evictions_ttl")
            self._cond.notify_all()
        unlink(path)
        logger.debug("restore cache: evicted %s after %.1f s idle", entry.key, self.idle_ttl_s)

    def _direct_lease(self, store: BlobStore, key: str, size: int) -> CacheLease:
        with self._cond:
            self._check_open()
            lease = self._register_direct(store, key, size)
            self._cond.notify_all()
            return lease

    def _count_direct_read(self) -> None:
        with self._cond:
            self._counts["direct_reads"] += 1

    def _stats(self) -> dict[str, int]:
        c = self._counts
        out = dict(c)
        out.update(
            leases_open=len(self._leases),
            files=len(self._lru),
            bytes_cached=self._bytes_cached,
            bytes_reserved=self._bytes_reserved,
            downloads_in_flight=sum(1 for e in self._entries.values()
                                    if e.state is _State.LOADING),
            evictions=c["evictions_ttl"] + c["evictions_budget"] + c["evictions_disk_full"],
            prefetch_queued=len(self._queue),
            bytes_prefetched=self._prefetched_bytes(),
        )
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(repr(self), "create a new LocalFileCache")

    def _check_pid(self) -> None:
        pid = os.getpid()
        if pid != self._pid:
            raise CacheError(f"{self!r} was created in process {self._pid} and used in forked "
                             f"process {pid}; create a new LocalFileCache, in a directory of its "
                             "own, in each process (never share one across fork)")


def _prefetchable(item: PrefetchItem) -> bool:
    """Whether a lease of ``item`` would get as far as downloading (else the lease raises the
    error, as without a prefetch)."""
    hint = item.size_hint
    if hint is not None and (isinstance(hint, bool) or not isinstance(hint, int) or hint < 0):
        return False
    try:
        check_key(item.key)
    except DstlError:
        return False
    return True


def _run_verify(verify: Verify, data: bytes, key: str) -> None:
    try:
        verify(data, key)
    except DstlError:
        raise
    except Exception as exc:
        raise CorruptObjectError(key, 0, f"verification failed ({type(exc).__name__}: {exc})",
                                 hint="the downloaded object is not what its reader "
                                      "expects") from exc


#: mypy proves here that the local cache is a :class:`~restore.leasing.LeasingCache` (the seam
#: ChangelogReader and restore_backend take).
_LOCAL_CACHE_IS_LEASING: type[LeasingCache] = LocalFileCache
