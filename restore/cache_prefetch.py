"""The restore cache's prefetch: a queue of objects a restore is about to lease, and its threads.

Theory of operation
-------------------
The cache's module docstring, *Prefetch*, says what a prefetch does; a :class:`Prefetcher`
does it for one :class:`~restore.cache.LocalFileCache`:

1. **Queue.** :meth:`Prefetcher.submit` queues a ticket's objects, first needed first, and
   starts ``dstl-prefetch`` threads up to the limit; a thread takes objects until the queue is
   empty, then retires (it is joined by :meth:`Prefetcher.cancel` or at close).
2. **Same flight as a lease.** A prefetch creates a LOADING entry in the
   :class:`~restore.cache_book.CacheBook`, so a lease of the object joins it like any waiter;
   it downloads with :class:`~restore.cache_download.Downloader` in prefetch mode (never
   evicts, never serves direct reads).
3. **Never raises.** An object already cached or in flight is left alone; one that does not fit
   is skipped; a failed download is forgotten (the entry ends GONE, not FAILED, so a waiting
   lease downloads anew and raises its own error). A published prefetch is an idle file.
4. **Cancel.** Drops the ticket's queued objects; with ``wait``, waits for its downloads in
   flight and for threads not yet in their loop.

Every count is guarded by the book's lock.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from dstl.errors import DstlError
from dstl.stores.base import BlobStore, check_key
from restore.cache_book import CLOSE_WAIT_S, CacheBook, Entry, EntryState, Outcome
from restore.cache_download import Downloader, Skipped
from restore.leasing import PrefetchItem

__all__ = ["CachePrefetch", "Prefetcher", "prefetchable"]

logger = logging.getLogger(__name__)


class CachePrefetch:
    """The ticket of one :meth:`LocalFileCache.prefetch <restore.cache.LocalFileCache.prefetch>`
    call (a :class:`~restore.leasing.PrefetchTicket`); its counts are guarded by the cache's
    lock."""

    __slots__ = ("_prefetcher", "queued", "running")

    def __init__(self, prefetcher: Prefetcher) -> None:
        self._prefetcher = prefetcher
        self.queued = 0  # objects in the cache's queue
        self.running = 0  # objects a prefetch thread works on

    def cancel(self, *, wait: bool = True) -> None:
        """Drop the objects not started yet; with ``wait``, wait (up to 30 s) for the ones in
        flight and for the threads that ran them to end. Idempotent, never raises."""
        self._prefetcher.cancel(self, wait)


@dataclass(frozen=True, slots=True)
class _Job:
    ticket: CachePrefetch
    store: BlobStore
    item: PrefetchItem


def prefetchable(item: PrefetchItem) -> bool:
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


class Prefetcher:
    """The prefetch queue and threads of one cache (see the module docstring).

    Args:
        book: the cache's bookkeeping (its lock guards the queue too).
        downloader: runs the downloads.
        threads: downloads run at once.
        owner: the cache's ``repr``, for log lines.
    """

    def __init__(self, book: CacheBook, downloader: Downloader, threads: int,
                 owner: str) -> None:
        self._book = book
        self._downloader = downloader
        self._threads = threads
        self._owner = owner
        self._queue: deque[_Job] = deque()  # prefetches not started yet, first needed first
        self._workers: set[threading.Thread] = set()  # prefetch threads running
        self._retired: list[threading.Thread] = []  # prefetch threads that ended (to be joined)
        # prefetch threads started that have not taken their first turn (cancel waits for them)
        self._fresh: set[threading.Thread] = set()

    def queued_locked(self) -> int:
        """Objects queued, not started (the ``prefetch_queued`` gauge)."""
        return len(self._queue)

    def submit(self, store: BlobStore, items: Iterable[PrefetchItem]) -> CachePrefetch:
        """Queue ``items`` (checked, distinct) and start threads as needed.

        Raises:
            ClosedError: the cache is closed.
        """
        book = self._book
        jobs = list(items)
        ticket = CachePrefetch(self)
        with book.cond:
            book.check_open_locked()
            self._queue.extend(_Job(ticket, store, item) for item in jobs)
            ticket.queued = len(jobs)
            # threads nobody joined (cancel without waiting: the agent's) are forgotten here
            self._retired = [t for t in self._retired if t.is_alive()]
            for _ in range(min(self._threads - len(self._workers), len(self._queue))):
                t = threading.Thread(target=self._worker, name="dstl-prefetch", daemon=True)
                self._workers.add(t)
                self._fresh.add(t)
                t.start()
            book.cond.notify_all()
        return ticket

    def cancel(self, ticket: CachePrefetch, wait: bool) -> None:
        """:meth:`CachePrefetch.cancel`."""
        book = self._book
        if os.getpid() != book.pid:
            return
        with book.cond:
            if ticket.queued:
                kept = deque(j for j in self._queue if j.ticket is not ticket)
                book.counts["prefetch_cancelled"] += len(self._queue) - len(kept)
                self._queue = kept
                ticket.queued = 0
                book.cond.notify_all()
            if not wait:
                return
            # its downloads, and threads not yet in their loop: with the queue empty such a
            # thread holds no download but would retire only after this returned
            if not book.cond.wait_for(
                    lambda: ticket.running == 0 and (bool(self._queue) or not self._fresh),
                    CLOSE_WAIT_S):
                logger.warning("%s: prefetch downloads still running after %.0f s; they end on "
                               "their own", self._owner, CLOSE_WAIT_S)
            retired, self._retired = self._retired, []
        for t in retired:
            t.join(CLOSE_WAIT_S)

    def drop_everything_locked(self) -> list[threading.Thread]:
        """At close (the book is closed): cancel the queue; returns the threads to join."""
        for job in self._queue:
            job.ticket.queued -= 1
        self._book.counts["prefetch_cancelled"] += len(self._queue)
        self._queue.clear()
        threads = [*self._workers, *self._retired]
        self._retired.clear()
        return threads

    # ------------------------------------------------------------------ the threads

    def _worker(self) -> None:
        """A ``dstl-prefetch`` thread: take queued objects until the queue is empty."""
        book = self._book
        me = threading.current_thread()
        finished: CachePrefetch | None = None
        while True:
            with book.cond:
                self._fresh.discard(me)
                if finished is not None:
                    finished.running -= 1  # in the same turn as retiring: cancel() can join us
                if book.closed or not self._queue:
                    self._workers.discard(me)
                    self._retired.append(me)
                    book.cond.notify_all()
                    return
                job = self._queue.popleft()
                job.ticket.queued -= 1
                job.ticket.running += 1
                book.cond.notify_all()
            finished = job.ticket
            try:
                self._prefetch_one(job.store, job.item)
            except Exception as exc:  # a bug here must not kill the thread or the restore
                logger.error("restore cache: prefetch of %s/%s failed unexpectedly",
                             job.store.location, job.item.key, exc_info=exc)

    def _prefetch_one(self, store: BlobStore, item: PrefetchItem) -> None:
        """Own the flight of ``item`` unless it is cached, in flight or cannot fit."""
        book = self._book
        ident = (store.location, item.key)
        with book.cond:
            if book.closed:
                return
            if ident in book.entries:
                book.counts["prefetch_present"] += 1
                return
            entry = Entry(ident)
            entry.prefetched = True
            if book.max_bytes is not None and item.size_hint is not None:
                # checked and reserved in one turn, so concurrent prefetches cannot overshoot
                if not book.prefetch_fits_locked(item.size_hint):
                    book.counts["prefetch_skipped"] += 1
                    return
                entry.reserved = item.size_hint
                book.bytes_reserved += item.size_hint
            book.entries[ident] = entry
            book.cond.notify_all()
        self._fly(entry, store, item)

    def _fly(self, entry: Entry, store: BlobStore, item: PrefetchItem) -> None:
        """A prefetch's flight: publish an idle file, or end GONE (leases waiting on it then
        download anew)."""
        book = self._book
        outcome: Outcome | None = None
        try:
            outcome = self._downloader.fetch(entry, store, item.key, item.verify,
                                             item.size_hint, prefetch=True)
            assert outcome.path is not None  # a prefetch never serves direct reads
            with book.cond:
                book.check_open_locked()
                book.publish_locked(entry, outcome)
                book.schedule_expiry_locked(entry)  # idle until leased: evictable like any idle
                book.cond.notify_all()
        except Skipped as why:
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

    def _forget(self, entry: Entry, outcome: Outcome | None, counter: str) -> None:
        """End a prefetch's flight with nothing cached (GONE, not FAILED: a lease waiting on it
        downloads anew, so it raises its own error, not the prefetch's)."""
        self._book.end_flight(entry, outcome, EntryState.GONE, counter)
