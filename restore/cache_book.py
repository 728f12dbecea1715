"""The restore cache's bookkeeping: its entries, their states, the byte budget and the idle TTL.

Theory of operation
-------------------
A :class:`CacheBook` is what :class:`~restore.cache.LocalFileCache` knows about its files, and
the rules that change it (the cache's module docstring: the entry states, *Budget*, *Idle TTL*),
behind one condition variable, :attr:`CacheBook.cond`. It never does I/O under that lock:
methods that evict return the paths, and their callers unlink them after the lock is released
(:meth:`CacheBook.reserve` and :meth:`CacheBook.evict_idle` unlink themselves, outside it).

Methods named ``..._locked`` are called with :attr:`CacheBook.cond` held; the others take it.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

from dstl.errors import ClosedError
from dstl.timer import ThreadTimer, Timer, TimerHandle
from restore.cache_directory import unlink

__all__ = ["CLOSE_WAIT_S", "PREFETCH_BUDGET_SHARE", "CacheBook", "Entry", "EntryState",
           "Outcome"]

logger = logging.getLogger(__name__)

#: How long ``close()`` waits for downloads in flight to finish and clean up their temp files.
CLOSE_WAIT_S = 30.0
#: The share of ``max_bytes`` that prefetched objects no lease has taken yet may hold: the rest
#: stays for the leases (a prefetch never evicts anything to make room).
PREFETCH_BUDGET_SHARE = 0.5
#: The prefetch counters of :meth:`LocalFileCache.stats <restore.cache.LocalFileCache.stats>`.
PREFETCH_COUNTS = ("prefetch_started", "prefetch_joined", "prefetch_present", "prefetch_skipped",
                   "prefetch_failed", "prefetch_cancelled", "prefetch_evicted")


class EntryState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DIRECT = "direct"
    FAILED = "failed"
    GONE = "gone"


class Entry:
    """One object of one store in the cache (all fields guarded by the book's lock)."""

    __slots__ = ("done", "error", "ident", "key", "leases", "path", "prefetched", "reserved",
                 "size", "state", "ttl", "ttl_gen")

    def __init__(self, ident: tuple[str, str]) -> None:
        self.ident = ident
        self.key = ident[1]
        self.state = EntryState.LOADING
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.path: str | None = None
        self.size = 0
        self.reserved = 0  # budget bytes held while LOADING
        self.leases = 0
        self.ttl: TimerHandle | None = None
        self.ttl_gen = 0
        self.prefetched = False  # downloaded by a prefetch, not leased yet


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a download gave: a published file, or (``path=None``) direct ranged reads."""

    path: str | None
    size: int


class CacheBook:
    """The entries of one cache and their budget (see the module docstring).

    Args:
        directory: the cache's directory (for messages).
        idle_ttl_s: how long an unleased file stays.
        max_bytes: the budget, or ``None``.
        timer: schedules idle evictions; ``None``: a ``ThreadTimer`` started on first use and
            stopped by :meth:`close_timer`.
        owner: the cache's ``repr``, for the closed error.
    """

    def __init__(self, directory: str, idle_ttl_s: float, max_bytes: int | None,
                 timer: Timer | None, owner: str) -> None:
        self.directory = directory
        self.idle_ttl_s = idle_ttl_s
        self.max_bytes = max_bytes
        self.pid = os.getpid()
        self._owner = owner
        self._timer = timer
        self._own_timer = timer is None
        self.cond = threading.Condition()  # the map lock: bookkeeping only, never held for I/O
        self.entries: dict[tuple[str, str], Entry] = {}
        self.lru: OrderedDict[tuple[str, str], Entry] = OrderedDict()  # READY, oldest first
        self.closed = False
        self.bytes_cached = 0
        self.bytes_reserved = 0
        self.counts = dict.fromkeys(
            ("downloads", "hits", "waits", "bytes_downloaded", "download_failures",
             "evictions_ttl", "evictions_budget", "evictions_disk_full", "direct_leases",
             "direct_reads", *PREFETCH_COUNTS), 0)

    # ------------------------------------------------------------------ reading (lock held)

    def check_open_locked(self) -> None:
        if self.closed:
            raise ClosedError(self._owner, "create a new LocalFileCache")

    def prefetch_fits_locked(self, size: int) -> bool:
        """Whether a prefetch of ``size`` bytes fits the free budget and the prefetch share
        (a prefetch never evicts)."""
        assert self.max_bytes is not None
        free = self.max_bytes - self.bytes_cached - self.bytes_reserved
        prefetched = self.prefetched_bytes_locked()
        return size <= free and prefetched + size <= self.max_bytes * PREFETCH_BUDGET_SHARE

    def prefetched_bytes_locked(self) -> int:
        """Bytes of prefetches no lease has taken yet: reserved in flight, or cached."""
        return (sum(e.reserved for e in self.entries.values()
                    if e.prefetched and e.state is EntryState.LOADING)
                + sum(e.size for e in self.lru.values() if e.prefetched))

    def stats_locked(self) -> dict[str, int]:
        """The counters and the gauges the book knows (the cache adds its leases and queue)."""
        c = self.counts
        out = dict(c)
        out.update(
            files=len(self.lru),
            bytes_cached=self.bytes_cached,
            bytes_reserved=self.bytes_reserved,
            downloads_in_flight=sum(1 for e in self.entries.values()
                                    if e.state is EntryState.LOADING),
            evictions=c["evictions_ttl"] + c["evictions_budget"] + c["evictions_disk_full"],
            bytes_prefetched=self.prefetched_bytes_locked(),
        )
        return out

    def budget_message(self, key: str, size: int) -> str:
        assert self.max_bytes is not None
        with self.cond:
            leased = sum(e.size for e in self.lru.values() if e.leases)
            reserved = self.bytes_reserved
        if size > self.max_bytes:
            return (f"object {key} ({size} bytes) is larger than the restore cache budget "
                    f"max_bytes={self.max_bytes} of {self.directory}")
        return (f"object {key} ({size} bytes) does not fit in the restore cache budget "
                f"max_bytes={self.max_bytes} of {self.directory}: {leased} bytes are held by "
                f"open leases and {reserved} reserved by downloads in flight")

    # ------------------------------------------------------------------ changing (lock held)

    def retain_locked(self, entry: Entry) -> None:
        """Count one more lease of a READY entry (its idle TTL cancelled)."""
        self.cancel_ttl_locked(entry)
        if entry.prefetched:
            entry.prefetched = False
            self.counts["prefetch_joined"] += 1
        entry.leases += 1
        self.lru.move_to_end(entry.ident)

    def release_locked(self, entry: Entry) -> None:
        """One lease of ``entry`` fewer; the last one schedules its idle eviction."""
        entry.leases -= 1
        if entry.leases == 0 and entry.state is EntryState.READY and not self.closed:
            self.lru.move_to_end(entry.ident)
            self.schedule_expiry_locked(entry)

    def publish_locked(self, entry: Entry, outcome: Outcome) -> None:
        """A download ended: its reservation becomes its size, and with a file it is READY."""
        self.bytes_reserved -= entry.reserved
        entry.reserved = 0
        entry.size = outcome.size
        if outcome.path is None:
            entry.state = EntryState.DIRECT
            del self.entries[entry.ident]
        else:
            entry.state = EntryState.READY
            entry.path = outcome.path
            self.bytes_cached += outcome.size
            self.lru[entry.ident] = entry

    def remove_locked(self, entry: Entry, counter: str) -> str:
        """Forget a READY entry without leases; return its path (the caller unlinks it)."""
        if self.entries.get(entry.ident) is entry:
            del self.entries[entry.ident]
        self.lru.pop(entry.ident, None)
        self.cancel_ttl_locked(entry)
        self.bytes_cached -= entry.size
        entry.state = EntryState.GONE
        self.counts[counter] += 1
        if entry.prefetched:
            self.counts["prefetch_evicted"] += 1
        assert entry.path is not None
        return entry.path

    def cancel_ttl_locked(self, entry: Entry) -> None:
        entry.ttl_gen += 1  # a callback that already fired but has not run yet sees a new gen
        if entry.ttl is not None:
            entry.ttl.cancel()
            entry.ttl = None

    def schedule_expiry_locked(self, entry: Entry) -> None:
        self.cancel_ttl_locked(entry)
        if self._timer is None:
            self._timer = ThreadTimer("cache")
        entry.ttl = self._timer.schedule(self.idle_ttl_s,
                                         functools.partial(self._expire, entry, entry.ttl_gen))

    def take_everything_locked(self) -> list[Entry]:
        """Mark the book closed and empty its maps; returns the entries (TTLs cancelled)."""
        self.closed = True
        entries = list(self.entries.values())
        self.entries.clear()
        self.lru.clear()
        for e in entries:
            self.cancel_ttl_locked(e)
        return entries

    # ------------------------------------------------------------------ taking the lock

    def end_flight(self, entry: Entry, outcome: Outcome | None, state: EntryState,
                   counter: str, error: BaseException | None = None) -> None:
        """End a flight with nothing cached: its file (if any) removed, its entry out of the
        map, its reservation given back, ``state`` (FAILED with ``error``, or GONE) set and
        the waiters woken."""
        if outcome is not None and outcome.path is not None:
            unlink(outcome.path)
        with self.cond:
            if self.entries.get(entry.ident) is entry:
                del self.entries[entry.ident]
            self.bytes_reserved -= entry.reserved
            entry.reserved = 0
            entry.state = state
            if error is not None:
                entry.error = error
            self.counts[counter] += 1
            self.cond.notify_all()
        entry.done.set()

    def count(self, counter: str, n: int = 1) -> None:
        with self.cond:
            self.counts[counter] += n
            self.cond.notify_all()

    def reserve(self, entry: Entry, size: int, *, prefetch: bool = False) -> bool:
        """Reserve ``size`` budget bytes for ``entry``: a lease evicts idle files (those nobody
        asked for first, in LRU order, then prefetched ones, furthest-needed first) and waits
        for prefetches in flight that hold the room it needs; a prefetch takes free room only."""
        assert self.max_bytes is not None
        victims: list[str] = []
        idle: list[Entry] = []
        used = 0
        with self.cond:
            while True:
                self.check_open_locked()
                self.bytes_reserved -= entry.reserved
                entry.reserved = 0
                if prefetch:
                    if not self.prefetch_fits_locked(size):
                        return False
                    break
                used = self.bytes_cached + self.bytes_reserved
                idle = [e for e in self.lru.values() if not e.leases]
                evictable = sum(e.size for e in idle)
                flying = sum(e.reserved for e in self.entries.values()
                             if e.prefetched and e.state is EntryState.LOADING)
                if size > self.max_bytes or used - evictable - flying + size > self.max_bytes:
                    return False  # evicting would not help: evict nothing
                if used - evictable + size <= self.max_bytes:
                    break
                # prefetches in flight hold the room: once published they are idle, evictable
                self.cond.wait(CLOSE_WAIT_S)
            # idle is empty for a prefetch: it never evicts
            for e in [*(e for e in idle if not e.prefetched),
                      *(e for e in reversed(idle) if e.prefetched)]:
                if used + size <= self.max_bytes:
                    break
                used -= e.size
                victims.append(self.remove_locked(e, "evictions_budget"))
            entry.reserved = size
            self.bytes_reserved += size
            self.cond.notify_all()
        for path in victims:
            unlink(path)
        if victims:
            logger.debug("restore cache %s: evicted %d idle files (LRU) to fit %s (%d bytes)",
                         self.directory, len(victims), entry.key, size)
        return True

    def evict_idle(self) -> int:
        """Evict every unleased file (the disk is full); return how many."""
        with self.cond:
            victims = [self.remove_locked(e, "evictions_disk_full")
                       for e in list(self.lru.values()) if not e.leases]
            self.cond.notify_all()
        for path in victims:
            unlink(path)
        if victims:
            logger.warning("restore cache %s: local disk full, evicted %d idle files",
                           self.directory, len(victims))
        return len(victims)

    def close_timer(self) -> None:
        """Stop the timer the book started (a timer passed in belongs to its owner)."""
        if self._own_timer and self._timer is not None:
            self._timer.close()

    def _expire(self, entry: Entry, gen: int) -> None:
        if os.getpid() != self.pid:
            return
        with self.cond:
            # The generation check is the fix of Flink's quirk: a timer scheduled before the
            # file's last use never evicts it, even if its cancel() raced with its firing.
            if self.closed or entry.state is not EntryState.READY or entry.leases \
                    or entry.ttl_gen != gen:
                return
            entry.ttl = None
            path = self.remove_locked(entry, "evictions_ttl")
            self.cond.notify_all()
        unlink(path)
        logger.debug("restore cache: evicted %s after %.1f s idle", entry.key, self.idle_ttl_s)
