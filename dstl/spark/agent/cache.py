"""The executor's restore cache: one :class:`~restore.cache.LocalFileCache` in the executor agent,
leased through by every Python worker of the executor.

Theory of operation
-------------------
*Why in the agent.* Segments hold the change sets of every task of an executor, so after a
failure the executor's workers restore from the same few objects. With a cache per worker, each
object came over the network once per worker, and a worker that Spark SIGKILLed left its cache
directory behind. The agent outlives the workers and sees all of them, so it owns ONE
``LocalFileCache`` in ``<agent directory>/cache`` (:class:`AgentCacheService`) and the workers
lease through it (:class:`AgentCache`, which ``ChangelogReader`` and ``restore_backend`` take like
any cache).

*What crosses the socket.* Names, not bytes. A ``lease`` request carries what the agent needs to
open the store (uri, storage options, DSTL options: the agent opens one
:class:`~dstl.ChangelogStorage` per distinct triple and shares it with its persists), the key, the
verify function's name in :data:`restore.reader.VERIFIERS` (a function cannot be sent) and the
size hint. The agent's cache downloads, verifies and publishes the object exactly as in process
(single flight, budget, idle TTL) and answers with a lease id, the published file's path and the
size. The worker opens its own descriptor on that path and reads with ``os.pread``. A *direct*
lease (the object cannot be cached and the cache is in ``on_full="direct"`` mode) has no path:
the worker reads ranges from its own store.

*Leases belong to connections.* Each worker has one connection to the agent, and the agent
records which connection holds which lease. ``release`` gives one back; when a connection ends —
the worker closed it, exited, or was SIGKILLed — every lease it still holds is released, so a
dead worker never pins a file. The agent's cache never deletes a leased file, and an open
descriptor keeps an unlinked file readable, so a worker never reads a file that vanished under it.

*Threads.* A lease may download for seconds, and the connection's frame loop must keep reading
(a worker's persist requests arrive on the same connection), so leases run on a small pool of
threads (``dstl-agent-cache``) that reply when done; ``release`` and ``cache_stats`` are quick and
answered in the frame loop. A lease granted after its connection ended is released at once.

*Prefetch.* A restore first tells the cache every object it will lease
(:meth:`AgentCache.prefetch`): one ``prefetch`` request names them (key, verify name, size hint)
under a ticket number of the worker's; the agent answers at once, opens the store on its lease
threads and queues the objects in its cache, whose prefetch threads download them — in the
agent's process, so truly in parallel with the worker's loading — and the worker's leases join
those downloads. ``cancel()`` of the ticket (a ``prefetch_cancel`` request; sent when the restore
ends) drops what has not started; so does the end of the connection. A verify function that
cannot be named leaves its object out of the prefetch (its lease raises, as without one).

*Failures.* Errors of the agent's cache (``ObjectNotFoundError``, ``CorruptObjectError``,
``CacheFullError``, ...) arrive in the worker as the same type with the same message. If the
agent dies, requests in flight fail with
:class:`~dstl.spark.agent.protocol.AgentUnavailableError`
(retryable: Spark retries the task, and the next worker starts a new agent, whose cache starts
empty and removes its predecessor's files); a lease whose file is already gone when the worker
opens it fails the same way. Leases whose file is open keep reading it.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import Any

from dstl.errors import (
    CacheError,
    ClosedError,
    ConfigError,
    DstlError,
    LeaseError,
    UsageError,
)
from dstl.options import DstlOptions
from dstl.spark.agent.client import AgentClient
from dstl.spark.agent.protocol import (
    AgentUnavailableError,
    CacheStatsRequest,
    LeaseReply,
    LeaseRequest,
    PrefetchCancelReply,
    PrefetchCancelRequest,
    PrefetchReply,
    PrefetchRequest,
    ReleaseRequest,
    StoreRef,
)
from dstl.stores.base import BlobStore
from restore.cache import (
    DEFAULT_IDLE_TTL_S,
    CacheLease,
    CachePrefetch,
    LocalFileCache,
    OnFull,
    Verify,
)
from restore.lease import Lease
from restore.leasing import LeasingCache, PrefetchItem
from restore.reader import VERIFIERS

__all__ = ["DEFAULT_LEASE_THREADS", "DEFAULT_LEASE_TIMEOUT_S", "AgentCache", "AgentCacheService",
           "AgentLease", "AgentPrefetch"]

logger = logging.getLogger(__name__)

#: Lease requests the agent serves at once. Downloads of different objects run in parallel (the
#: same object is downloaded once anyway); an executor runs a handful of tasks at a time, so a
#: few threads keep every restoring task busy without a thread per request.
DEFAULT_LEASE_THREADS = 4
#: How long a worker waits for the agent to grant a lease, download included: a snapshot of a few
#: GiB at tens of MB/s. Beyond that the agent is taken as hung and the task fails (Spark retries).
DEFAULT_LEASE_TIMEOUT_S = 300.0
#: How long a worker waits for the agent to answer a quick request (release, stats).
_QUICK_TIMEOUT_S = 10.0


def _verify_name(verify: Verify | None) -> str | None:
    """The name of a verify function in :data:`restore.reader.VERIFIERS`.

    Raises:
        UsageError: ``verify`` is not registered there (the agent could not run it).
    """
    if verify is None:
        return None
    for name, fn in VERIFIERS.items():
        if fn is verify:
            return name
    raise UsageError(f"AgentCache.lease(verify={verify!r}): the executor agent runs only the "
                     f"verify functions named in restore.reader.VERIFIERS ({sorted(VERIFIERS)}); "
                     "pass one of those, or use a LocalFileCache in this process")


# --------------------------------------------------------------------------- in the agent


class _Connection:
    """The leases of one worker connection (guarded by the service's lock)."""

    __slots__ = ("closed", "leases", "pending")

    def __init__(self) -> None:
        self.leases: dict[int, CacheLease] = {}
        self.pending = 0  # lease requests accepted and not yet granted or failed
        self.closed = False


class AgentCacheService:
    """The executor agent's restore cache: one :class:`LocalFileCache` for all its workers.

    Connection ids are the agent's: unique for the agent's life, never reused.

    Args:
        directory: the agent's directory; the cache lives in ``<directory>/cache`` (files a
            previous agent left there are removed on open).
        threads: lease requests served at once (:data:`DEFAULT_LEASE_THREADS`).
        idle_ttl_s, max_bytes, on_full: passed to :class:`LocalFileCache`.

    Raises:
        CacheError: the cache directory cannot be used.
        ConfigError: an argument is out of range.
    """

    def __init__(self, directory: str, *, threads: int = DEFAULT_LEASE_THREADS,
                 idle_ttl_s: float = DEFAULT_IDLE_TTL_S, max_bytes: int | None = None,
                 on_full: OnFull = "raise") -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ConfigError("threads", threads, "an integer >= 1", owner="AgentCacheService")
        self.cache = LocalFileCache(os.path.join(directory, "cache"), idle_ttl_s, max_bytes,
                                    on_full=on_full)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dstl-agent-cache")
        self._lock = threading.Lock()
        self._conns: dict[int, _Connection] = {}
        self._ids = itertools.count(1)
        self._closed = False
        # (connection, ticket) -> its prefetch in the cache (None: not queued yet)
        self._prefetches: dict[tuple[int, int], CachePrefetch | None] = {}

    def __repr__(self) -> str:
        return f"AgentCacheService({self.cache.directory!r})"

    def submit_prefetch(self, conn_id: int, ticket: int, open_store: Callable[[], BlobStore],
                        objects: Sequence[tuple[str, str | None, int | None]]) -> None:
        """Queue ``objects`` (key, verify name, size hint) in the cache's prefetch, as ticket
        ``ticket`` of connection ``conn_id``; ``open_store`` runs on the service's threads.

        Raises:
            UsageError: a verify name is not in :data:`restore.reader.VERIFIERS`.
            ClosedError: the service is closed.
        """
        items = [PrefetchItem(key, self._verify(name), hint) for key, name, hint in objects]
        with self._lock:
            self._check_open()
            self._prefetches[(conn_id, ticket)] = None
        try:
            self._pool.submit(self._start_prefetch, conn_id, ticket, open_store, items)
        except RuntimeError as exc:  # the pool was shut down: close() is running
            self.cancel_prefetch(conn_id, ticket)
            raise ClosedError(repr(self), "the executor agent is stopping") from exc

    def cancel_prefetch(self, conn_id: int, ticket: int) -> None:
        """Drop what prefetch ``ticket`` of ``conn_id`` has not started (unknown: nothing)."""
        with self._lock:
            prefetch = self._prefetches.pop((conn_id, ticket), None)
        if prefetch is not None:
            prefetch.cancel(wait=False)  # its downloads run on; the frame loop must not wait

    def _start_prefetch(self, conn_id: int, ticket: int, open_store: Callable[[], BlobStore],
                        items: list[PrefetchItem]) -> None:
        try:
            store = open_store()
            with self._lock:
                if (conn_id, ticket) not in self._prefetches:
                    return  # cancelled (or the connection ended) while the store was opened
            prefetch = self.cache.prefetch(store, items)
        except DstlError as exc:  # a hint: the worker's leases go their own way
            logger.info("agent restore cache: prefetch %d of connection %d not started: %s",
                        ticket, conn_id, exc)
            with self._lock:
                self._prefetches.pop((conn_id, ticket), None)
            return
        with self._lock:
            keep = (conn_id, ticket) in self._prefetches and not self._closed
            if keep:
                self._prefetches[(conn_id, ticket)] = prefetch
        if not keep:  # cancelled just now
            prefetch.cancel(wait=False)

    def lease(self, conn_id: int, store: BlobStore, key: str, verify_name: str | None,
              size_hint: int | None) -> LeaseReply:
        """Lease ``key`` of ``store`` for connection ``conn_id`` (blocks while it downloads).

        Returns:
            The reply: ``lease`` (id), ``path`` (the published file, ``None`` for a direct
            lease) and ``size``.

        Raises:
            UsageError: ``verify_name`` is not in :data:`restore.reader.VERIFIERS`.
            ClosedError: the service is closed, or the connection ended meanwhile (the lease
                was given back at once).
            DstlError: whatever :meth:`LocalFileCache.lease` raises (``ObjectNotFoundError``,
                ``CorruptObjectError``, ``CacheFullError``, ...).
        """
        verify = self._verify(verify_name)
        self._begin(conn_id)
        return self._lease_begun(conn_id, lambda: store, key, verify, size_hint)

    def submit_lease(self, conn_id: int, open_store: Callable[[], BlobStore], key: str,
                     verify_name: str | None, size_hint: int | None) -> Future[LeaseReply]:
        """:meth:`lease` on the service's threads; ``open_store`` runs there too (opening a
        store may talk to it).

        The request is counted against the connection before this returns, so a
        :meth:`release_connection` that follows always sees it.

        Returns:
            A future of the reply fields of :meth:`lease` (or of its error).

        Raises:
            UsageError: unknown ``verify_name``.
            ClosedError: the service is closed.
        """
        verify = self._verify(verify_name)
        self._begin(conn_id)
        try:
            return self._pool.submit(self._lease_begun, conn_id, open_store, key, verify,
                                     size_hint)
        except RuntimeError as exc:  # the pool was shut down: close() is running
            self._end(conn_id, None)
            raise ClosedError(repr(self), "the executor agent is stopping; the task is "
                                          "retried") from exc

    def release(self, conn_id: int, lease_id: int) -> None:
        """Give back one lease of connection ``conn_id``.

        Raises:
            LeaseError: the connection holds no such lease (released twice, or taken on another
                connection).
            ClosedError: the service is closed.
        """
        with self._lock:
            self._check_open()
            conn = self._conns.get(conn_id)
            lease = conn.leases.pop(lease_id, None) if conn is not None else None
            if conn is not None and not conn.leases and not conn.pending:
                del self._conns[conn_id]
        if lease is None:
            raise LeaseError(f"lease {lease_id} is not held by connection {conn_id} of the "
                             f"executor agent's restore cache {self.cache.directory} (released "
                             "twice, or taken on another connection); release each lease once, "
                             "on the connection that took it")
        lease.release()

    def release_connection(self, conn_id: int) -> int:
        """The connection ended: give back every lease it holds, and any it is still granted.

        Returns:
            How many leases were released now.
        """
        with self._lock:
            mine = [k for k in self._prefetches if k[0] == conn_id]
        for _, ticket in mine:
            self.cancel_prefetch(conn_id, ticket)
        with self._lock:
            conn = self._conns.get(conn_id)
            if conn is None:
                return 0
            conn.closed = True
            leases = list(conn.leases.values())
            conn.leases.clear()
            if not conn.pending:
                del self._conns[conn_id]
        for lease in leases:
            lease.release()
        if leases:
            logger.info("agent restore cache: connection %d ended holding %d leases; released",
                        conn_id, len(leases))
        return len(leases)

    def stats(self) -> dict[str, int]:
        """The cache's :meth:`LocalFileCache.stats` (``downloads``, ``hits``, ``leases_open``, ...)."""
        return self.cache.stats()

    def close(self) -> None:
        """Stop taking leases, invalidate the outstanding ones, delete every file. Idempotent.

        Leases being downloaded fail with ``ClosedError``; workers keep reading the files they
        have open.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._conns.clear()
            self._prefetches.clear()  # the cache's close() drops their queue
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.cache.close()  # waits for downloads in flight, which then fail
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ internals

    def _verify(self, name: str | None) -> Verify | None:
        if name is None:
            return None
        verify = VERIFIERS.get(name) if isinstance(name, str) else None
        if verify is None:
            raise UsageError(f"unknown verify function {name!r} for the executor agent's restore "
                             f"cache (it knows {sorted(VERIFIERS)}); name one of those, as "
                             "AgentCache does for the functions in restore.reader.VERIFIERS")
        return verify

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(repr(self), "the executor agent is stopping; the task is retried")

    def _begin(self, conn_id: int) -> None:
        with self._lock:
            self._check_open()
            conn = self._conns.get(conn_id)
            if conn is None:
                conn = self._conns[conn_id] = _Connection()
            conn.pending += 1

    def _end(self, conn_id: int, lease: CacheLease | None) -> int | None:
        """Finish a request begun with :meth:`_begin`; the lease's id, or ``None`` when there is
        no lease or it must be given back (connection ended, service closed)."""
        with self._lock:
            conn = self._conns.get(conn_id)
            if conn is None:  # close() cleared the map
                return None
            conn.pending -= 1
            if lease is not None and not conn.closed and not self._closed:
                lease_id = next(self._ids)
                conn.leases[lease_id] = lease
                return lease_id
            if not conn.pending and (conn.closed or not conn.leases):
                del self._conns[conn_id]
            return None

    def _lease_begun(self, conn_id: int, open_store: Callable[[], BlobStore], key: str,
                     verify: Verify | None, size_hint: int | None) -> LeaseReply:
        try:
            store = open_store()
            lease = self.cache.lease(store, key, verify=verify, size_hint=size_hint)
        except BaseException:
            self._end(conn_id, None)
            raise
        lease_id = self._end(conn_id, lease)
        if lease_id is None:
            lease.release()
            self._check_open()
            raise ClosedError(f"connection {conn_id} of the executor agent",
                              "the worker went away before its lease was granted; the lease "
                              "was given back")
        return LeaseReply(lease_id, lease.path, lease.size)


# --------------------------------------------------------------------------- in a worker


class AgentLease(Lease):
    """A worker's lease of one object in the executor agent's cache (see
    :class:`restore.lease.Lease`: same contract as a :class:`~restore.cache.CacheLease`).

    Obtained from :meth:`AgentCache.lease`.

    Attributes:
        lease_id: the agent's id of the lease.

    Raises:
        AgentUnavailableError: (constructing) the published file is gone: the agent was replaced
            and its successor removed the files (retryable).
        CacheError: (constructing) the file cannot be opened for another reason.
    """

    _NEW_LEASE = "take a new lease with AgentCache.lease"

    def __init__(self, cache: AgentCache, lease_id: int, store: BlobStore, key: str, size: int,
                 path: str | None) -> None:
        super().__init__(store, key, size, path)
        self._cache = cache
        self.lease_id = lease_id
        if path is None:
            return
        try:
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            self._release(explicit=False)  # give it back to the agent
            if exc.errno == errno.ENOENT:
                raise AgentUnavailableError(
                    f"the executor agent's cached file {path} of {self.location}/{key} is gone "
                    f"({exc}): the agent was replaced and its successor removed its files; the "
                    "task fails and Spark retries it", key=key) from exc
            raise CacheError(f"cannot open the executor agent's cached file {path} of "
                             f"{self.location}/{key} ({exc}); check the agent directory's "
                             "permissions and the open-file limit") from exc

    def _check_pid(self) -> None:
        self._cache._check_pid()

    def _on_released(self, *, explicit: bool) -> None:
        self._cache._give_back(self, explicit=explicit)

    def _closed_reason(self) -> str:
        return "its AgentCache was closed, which invalidated the lease"


class AgentCache:
    """A worker's restore cache that leases through the executor agent's one cache.

    Use it wherever a :class:`~restore.cache.LocalFileCache` goes (``ChangelogReader(storage,
    cache=...)``, ``restore_backend(..., cache=...)``). It does not own ``client``.

    Args:
        client: this worker's connection to its executor agent.
        uri: the store's URI, as the worker's own :class:`~dstl.ChangelogStorage` was opened.
        storage_options: its fsspec options.
        options: its DSTL options (the agent opens one storage per uri, storage options and
            options, shared with the persists of the same store).
        timeout_s: how long a lease may take in the agent, download included.

    Raises:
        ConfigError: ``timeout_s`` is not > 0.
    """

    def __init__(self, client: AgentClient, uri: str, storage_options: dict[str, Any] | None,
                 options: DstlOptions | None = None, *,
                 timeout_s: float = DEFAULT_LEASE_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ConfigError("timeout_s", timeout_s, "seconds > 0", owner="AgentCache")
        options = options or DstlOptions()
        self._client = client
        self._store = StoreRef(uri, storage_options, options)
        self._timeout_s = timeout_s
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._leases: set[AgentLease] = set()
        self._closed = False
        self._tickets = itertools.count(1)

    def __repr__(self) -> str:
        return f"AgentCache({self._client.path!r}, {self._store.uri!r})"

    def __enter__(self) -> AgentCache:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def lease(self, store: BlobStore, key: str, *, verify: Verify | None = None,
              size_hint: int | None = None) -> AgentLease:
        """Lease the object ``key`` through the agent, which downloads it once per executor.

        Args:
            store: this worker's store of the same URI (messages; direct leases read from it).
            key: the object key.
            verify: one of the functions in :data:`restore.reader.VERIFIERS` (the agent runs it
                on the downloaded bytes before publishing them), or ``None``.
            size_hint: the object's size if known.

        Returns:
            An :class:`AgentLease`; use it as a context manager.

        Raises:
            UsageError: ``verify`` is not registered in ``VERIFIERS``, or a bad ``size_hint``.
            ObjectNotFoundError, CorruptObjectError, CacheFullError, StorageError: as the
                agent's :meth:`LocalFileCache.lease` raised them (same type and message).
            AgentUnavailableError: the agent is gone or did not answer within ``timeout_s``
                (retryable).
            ClosedError: this cache is closed.
            CacheError: used in a forked child.
        """
        self._check_pid()
        self._check_open()
        fut = self._client.request(LeaseRequest(self._store, key, _verify_name(verify),
                                                size_hint))
        try:
            reply = fut.result(self._timeout_s)
        except TimeoutError as exc:
            # the agent may still grant it: then give it back, without waiting on the reader
            fut.add_done_callback(self._release_late)
            raise AgentUnavailableError(f"the executor agent did not grant the lease of "
                                        f"{store.location}/{key} within {self._timeout_s}s; "
                                        "the task fails and Spark retries it", key=key) from exc
        lease = AgentLease(self, reply.lease, store, key, reply.size, reply.path)
        with self._lock:
            if not self._closed:
                self._leases.add(lease)
                return lease
        lease.release_quietly()  # close() ran meanwhile
        raise ClosedError(repr(self))

    def prefetch(self, store: BlobStore, objects: Sequence[PrefetchItem]) -> AgentPrefetch:
        """Have the agent's cache start downloading ``objects`` (see
        :meth:`LocalFileCache.prefetch`); returns at once, without waiting for the agent.

        An object whose ``verify`` is not in :data:`restore.reader.VERIFIERS` is left out (its
        lease raises ``UsageError``, as without a prefetch).

        Raises:
            AgentUnavailableError: the connection to the agent is broken.
            ClosedError: this cache is closed.
            CacheError: used in a forked child.
        """
        self._check_pid()
        self._check_open()
        named: list[tuple[str, str | None, int | None]] = []
        for item in objects:
            try:
                named.append((item.key, _verify_name(item.verify), item.size_hint))
            except UsageError as exc:
                logger.debug("prefetch of %s/%s left out: %s", store.location, item.key, exc)
        ticket = next(self._tickets)
        fut = self._client.request(PrefetchRequest(self._store, ticket, tuple(named)))
        fut.add_done_callback(functools.partial(_log_refusal, "prefetch", ticket))
        return AgentPrefetch(self, ticket)

    def stats(self) -> dict[str, int]:
        """The agent cache's stats (:meth:`LocalFileCache.stats`: ``downloads``, ``hits``,
        ``leases_open`` of all workers, ...).

        Raises:
            AgentUnavailableError: the agent is gone or did not answer.
            CacheError: used in a forked child.
        """
        self._check_pid()
        return self._client.call(CacheStatsRequest(), _QUICK_TIMEOUT_S).stats

    def close(self) -> None:
        """Give back every lease still open (later reads raise ``LeaseError``). Idempotent; the
        client stays open. In a forked child this does nothing (the leases are the parent's)."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            leases = list(self._leases)
            self._leases.clear()
        for lease in leases:
            lease.invalidate()
            self._send_release(lease, explicit=False)
        if leases:
            logger.warning("%r closed with %d leases still open (given back)", self, len(leases))

    # ------------------------------------------------------------------ internals

    def _give_back(self, lease: AgentLease, *, explicit: bool) -> None:
        with self._lock:
            self._leases.discard(lease)
        self._send_release(lease, explicit=explicit)

    def _send_release(self, lease: AgentLease, *, explicit: bool) -> None:
        try:
            self._client.request(ReleaseRequest(lease.lease_id)).result(_QUICK_TIMEOUT_S)
        except AgentUnavailableError as exc:
            # the connection is gone, and with it every lease it held: nothing to give back
            logger.debug("release of %r: agent connection lost (%s)", lease, exc)
            return
        except TimeoutError:
            logger.warning("release of %r: the executor agent did not answer within %ss; the "
                           "lease is given back when this worker's connection ends", lease,
                           _QUICK_TIMEOUT_S)
            return
        except DstlError as err:  # the agent refused it (LeaseError, ClosedError, ...)
            if explicit:
                raise
            logger.warning("release of %r failed in the executor agent: %s", lease, err)

    def _release_late(self, fut: Future[LeaseReply]) -> None:
        """A lease granted after its requester gave up: give it back (on the client's reader
        thread, so fire and forget)."""
        if fut.exception() is not None:
            return
        lease_id = fut.result().lease
        try:
            self._client.request(ReleaseRequest(lease_id))
        except DstlError as exc:
            logger.debug("late release of lease %s: %s", lease_id, exc)

    def _cancel_prefetch(self, ticket: int) -> None:
        """Send the cancel and do not wait: the downloads are the agent's."""
        try:
            fut = self._client.request(PrefetchCancelRequest(ticket))
        except DstlError as exc:  # the connection is gone, and its prefetches with it
            logger.debug("cancel of prefetch %d: %s", ticket, exc)
            return
        fut.add_done_callback(functools.partial(_log_refusal, "prefetch_cancel", ticket))

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(repr(self), "create a new AgentCache")

    def _check_pid(self) -> None:
        pid = os.getpid()
        if pid != self._pid:
            raise CacheError(f"{self!r} was created in process {self._pid} and used in forked "
                             f"process {pid}; create a new AgentClient and AgentCache in each "
                             "process")


class AgentPrefetch:
    """The worker's ticket of one :meth:`AgentCache.prefetch` (a
    :class:`~restore.leasing.PrefetchTicket`)."""

    def __init__(self, cache: AgentCache, ticket: int) -> None:
        self._cache = cache
        self.ticket = ticket
        self._cancelled = False

    def cancel(self) -> None:
        """Ask the agent to drop what has not started (once; never raises, never waits)."""
        if self._cancelled or os.getpid() != self._cache._pid:
            return
        self._cancelled = True
        self._cache._cancel_prefetch(self.ticket)


def _log_refusal(what: str, ticket: int,
                 fut: Future[PrefetchReply] | Future[PrefetchCancelReply]) -> None:
    """A prefetch is a hint: the agent refusing one is logged, never raised."""
    exc = None if fut.cancelled() else fut.exception()
    if exc is not None:
        logger.info("the executor agent refused %s %d: %s", what, ticket, exc)


#: mypy proves here that the agent's cache is a :class:`~restore.leasing.LeasingCache` too.
_AGENT_CACHE_IS_LEASING: type[LeasingCache] = AgentCache
