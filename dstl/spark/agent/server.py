"""The executor agent process: accept loop, one thread per worker connection, op dispatch.

Theory of operation
-------------------
*Why a process.* A Python worker runs one task at a time and a partition does not stick to a
worker, so batching across an executor's tasks needs something that outlives workers and sees all
of them (:mod:`dstl.spark.agent` tells the whole story; :mod:`~dstl.spark.agent.spawn` how it
is found and started).

*Serving.* :class:`AgentServer` listens on the agent's socket (mode 0600 in a 0700 directory)
and runs one ``dstl-agent-conn`` thread per worker connection, which reads frames, decodes each
into a typed request (:func:`~dstl.spark.agent.protocol.decode_request`) and answers it — in
the frame loop for the quick ops, from another thread for the slow ones: a ``persist`` is
answered by the batching scheduler's upload threads once its segment is durable, a ``lease`` by
the restore cache's threads once the object is local (a ``prefetch`` is answered at once: its
downloads run on the cache's prefetch threads, and later leases join them). A failed request is answered with
:func:`~dstl.spark.agent.protocol.encode_error`; a frame that cannot be read ends the
connection. When a connection ends, the restore cache gives back every lease it still holds
(a SIGKILLed worker must not pin files).

*What it owns.* One :class:`~dstl.ChangelogStorage` per store named in requests (its segment
registry never deletes: segments written here hold change sets of many workers, and the
driver's coordinator owns what checkpoints reference), the executor's restore cache
(:class:`~dstl.spark.agent.cache.AgentCacheService`, opened at start so a dead predecessor's
files are removed at once) and the materializer
(:class:`~dstl.spark.agent.materializer.AgentMaterializer`).

*Exit.* The agent stops when told (``shutdown``), when the process it watches (the executor
JVM) is gone, or when its directory is removed (SPARK_LOCAL_DIRS goes with the executor). It
closes the materializer first (the snapshot in progress finishes), then the cache (its downloads
use the storages), then the storages.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future

from dstl.errors import ClosedError, DstlError
from dstl.handle import ChangeSetRef
from dstl.metrics import merged_snapshot
from dstl.scheduler import UploadTask
from dstl.segment import ChangeSet
from dstl.spark.agent.cache import AgentCacheService
from dstl.spark.agent.materializer import AgentMaterializer
from dstl.spark.agent.protocol import (
    AgentProtocolError,
    CacheStatsReply,
    CacheStatsRequest,
    CommittedReply,
    CommittedRequest,
    Header,
    LeaseReply,
    LeaseRequest,
    MaterializationReply,
    MaterializationRequest,
    MetricsReply,
    MetricsRequest,
    OfferedSnapshot,
    PersistReply,
    PersistRequest,
    PingReply,
    PingRequest,
    PrefetchCancelReply,
    PrefetchCancelRequest,
    PrefetchReply,
    PrefetchRequest,
    ReleaseReply,
    ReleaseRequest,
    Reply,
    Request,
    ShutdownReply,
    ShutdownRequest,
    StoreRef,
    decode_request,
    encode_error,
    recv_frame,
    send_frame,
)
from dstl.spark.agent.spawn import socket_path
from dstl.storage import ChangelogStorage
from dstl.stores.base import BlobStore
from dstl.stores.local import pid_alive

__all__ = ["AgentServer"]

logger = logging.getLogger(__name__)

#: How often the accept loop and the watcher look at the stop flag, the watched process and the
#: directory.
_POLL_S = 0.5
#: The agent's log lines sent with each batch's status.
_LOG_TAIL_LINES = 5

#: Answers one request: a reply, or the error the request failed with.
Respond = Callable[[Reply | BaseException], None]


class AgentServer:
    """The executor agent (see the module docstring).

    Args:
        directory: the agent directory (``agent.log``, the restore cache; the socket is named
            after it).
        watch_pid: exit when this process (the executor JVM) is gone; ``None``: do not watch.
    """

    def __init__(self, directory: str, watch_pid: int | None) -> None:
        self.directory = directory
        self.watch_pid = watch_pid
        self.storages: dict[str, ChangelogStorage] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.requests_served = 0
        self.connections_accepted = 0
        self.cache_service: AgentCacheService | None = None  # see restore_cache()
        self.materializer = AgentMaterializer()
        self.conn_ids = itertools.count(1)  # names a connection's cache leases; never reused

    def storage_for(self, store: StoreRef) -> ChangelogStorage:
        """The agent's storage of ``store``, opened on first use."""
        key = store.key()
        with self.lock:
            st = self.storages.get(key)
            if st is None:
                st = ChangelogStorage(store.uri, options=store.options,
                                      storage_options=store.storage_options)
                st.registry.deletes_enabled = False  # shared segments: never deleted here
                self.storages[key] = st
            return st

    def restore_cache(self) -> AgentCacheService:
        """The executor's restore cache (``<directory>/cache``), opened on first use.

        Raises:
            ClosedError: the agent is stopping.
            CacheError: the cache directory cannot be used.
        """
        with self.lock:
            if self.cache_service is None:
                if self.stop.is_set():
                    raise ClosedError("the executor agent's restore cache",
                                      "the agent is stopping; the task is retried")
                self.cache_service = AgentCacheService(self.directory)
            return self.cache_service

    def serve(self) -> None:
        """Serve until stopped (see the module docstring); closes everything on the way out."""
        path = socket_path(self.directory)
        srv = _listen(path)
        threading.Thread(target=self._watch, name="dstl-agent-watch", daemon=True).start()
        try:
            self.restore_cache()  # now, so the files a dead predecessor left are removed now
        except DstlError as exc:
            logger.warning("restore cache not opened at start (each lease tries again): %s", exc)
        logger.info("dstl agent %d serving on %s (watching pid %s)", os.getpid(), path,
                    self.watch_pid)
        try:
            while not self.stop.is_set():
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    continue
                self.connections_accepted += 1
                threading.Thread(target=self._connection, args=(conn,),
                                 name="dstl-agent-conn", daemon=True).start()
        finally:
            srv.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self._close_parts()

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> tuple[str, ...]:
        """The agent's last log lines (the driver shows them with each batch)."""
        try:
            with open(os.path.join(self.directory, "agent.log"), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                return tuple(f.read().decode("utf-8", "replace").splitlines()[-lines:])
        except OSError:
            return ()

    def metrics(self) -> dict[str, float]:
        """``agent.*``: the agent's own counters, its storages' metrics merged, its cache's
        stats and its materializer's counters."""
        out: dict[str, float] = {"agent.pid": float(os.getpid()),
                                 "agent.requests": float(self.requests_served),
                                 "agent.connections": float(self.connections_accepted)}
        # one storage per store the agent writes to: counters add up, histograms merge
        merged = merged_snapshot([st.metrics_registry for st in list(self.storages.values())])
        out.update({f"agent.{k}": v for k, v in merged.items()})
        cache = self.cache_service
        if cache is not None:
            out.update({f"agent.cache.{k}": float(v) for k, v in cache.stats().items()})
        out.update({f"agent.{k}": v for k, v in self.materializer.metrics().items()})
        return out

    # ------------------------------------------------------------------ lifecycle

    def _close_parts(self) -> None:
        self.materializer.close()  # finishes the snapshot in progress; before the storages
        with self.lock:
            cache, self.cache_service = self.cache_service, None
        if cache is not None:  # before the storages: its downloads use them
            cache.close()
        for st in list(self.storages.values()):
            st.close()
        logger.info("dstl agent %d stopped", os.getpid())

    def _watch(self) -> None:
        while not self.stop.wait(_POLL_S):
            if self.watch_pid is not None and not pid_alive(self.watch_pid):
                logger.info("executor process %d is gone; agent exits", self.watch_pid)
                self.stop.set()
            elif not os.path.isdir(self.directory):
                # SPARK_LOCAL_DIRS is removed when the executor (or local SparkContext) stops
                logger.info("agent directory %s is gone; agent exits", self.directory)
                self.stop.set()

    # ------------------------------------------------------------------ one connection

    def _connection(self, conn: socket.socket) -> None:
        send_lock = threading.Lock()
        conn_id = next(self.conn_ids)

        def send(request_id: object, header: Header) -> None:
            with send_lock, contextlib.suppress(OSError):
                send_frame(conn, {"id": request_id, **header})

        def responder(request_id: object) -> Respond:
            def respond(result: Reply | BaseException) -> None:
                send(request_id, encode_error(result).encode()
                     if isinstance(result, BaseException) else result.encode())
            return respond

        try:
            while not self.stop.is_set():
                try:
                    header, body = recv_frame(conn)
                except (OSError, AgentProtocolError) as exc:  # closed, or unreadable
                    if isinstance(exc, AgentProtocolError):
                        logger.warning("connection %d dropped: %s", conn_id, exc)
                    return
                self.requests_served += 1
                respond = responder(header.get("id"))
                try:
                    self._dispatch(conn_id, decode_request(header, body), respond)
                except DstlError as exc:
                    respond(exc)
        finally:
            # a worker that exited or was SIGKILLed must not pin cached files
            cache = self.cache_service
            if cache is not None:
                cache.release_connection(conn_id)
            conn.close()

    def _dispatch(self, conn_id: int, request: Request[Reply], respond: Respond) -> None:
        """Answer one request (``persist`` and ``lease`` answer later, from other threads).

        Raises:
            DstlError: the request failed here (answered by the caller).
        """
        match request:
            case PersistRequest():
                self._persist(request, respond)
            case LeaseRequest():
                self._lease(conn_id, request, respond)
            case ReleaseRequest():
                self.restore_cache().release(conn_id, request.lease)
                respond(ReleaseReply())
            case PrefetchRequest():
                self._prefetch(conn_id, request)
                respond(PrefetchReply())
            case PrefetchCancelRequest():
                self.restore_cache().cancel_prefetch(conn_id, request.ticket)
                respond(PrefetchCancelReply())
            case CacheStatsRequest():
                respond(CacheStatsReply(self.restore_cache().stats()))
            case CommittedRequest():
                self._committed(request)
                respond(CommittedReply(self.metrics(), self.log_tail()))
            case MaterializationRequest():
                respond(self._materialization(request))
            case MetricsRequest():
                respond(MetricsReply(self.metrics(), self.log_tail()))
            case PingRequest():
                respond(PingReply(os.getpid()))
            case ShutdownRequest():
                respond(ShutdownReply())
                self.stop.set()
            case _:  # decode_request knows no other op
                raise AgentProtocolError("request", f"no handler for {type(request).__name__}")

    # ------------------------------------------------------------------ the ops

    def _persist(self, request: PersistRequest, respond: Respond) -> None:
        """Hand the change sets to the store's batching scheduler; answered once durable."""
        st = self.storage_for(request.store)

        store_key = request.store.key()

        def ok(pairs: list[tuple[ChangeSet, ChangeSetRef]]) -> None:
            # before the answer: the task commits its table only once answered, so a read
            # transaction that sees the commit finds these change sets noted
            self.materializer.note_persisted(
                store_key, [(cs.log_id, r.key, r.offset, cs.sqn, cs.body) for cs, r in pairs])
            respond(PersistReply(tuple((r.key, r.offset, r.length) for _, r in pairs)))

        def failed(_: list[ChangeSet], exc: BaseException) -> None:
            respond(exc)

        st.scheduler.upload(UploadTask(list(request.change_sets), ok, failed))

    def _lease(self, conn_id: int, request: LeaseRequest, respond: Respond) -> None:
        """Lease through the restore cache, on its threads (downloads take time)."""
        def open_store() -> BlobStore:  # on the cache's thread: opening a store may talk to it
            return self.storage_for(request.store).store

        def done(f: Future[LeaseReply]) -> None:
            if f.cancelled():  # the cache closed before the request ran
                respond(ClosedError("the executor agent's restore cache",
                                    "the agent is stopping; the task is retried"))
                return
            exc = f.exception()
            respond(exc if exc is not None else f.result())

        fut = self.restore_cache().submit_lease(conn_id, open_store, request.key,
                                                request.verify, request.size_hint)
        fut.add_done_callback(done)

    def _prefetch(self, conn_id: int, request: PrefetchRequest) -> None:
        """Queue the objects in the restore cache; the store is opened on the cache's threads."""
        def open_store() -> BlobStore:
            return self.storage_for(request.store).store

        self.restore_cache().submit_prefetch(conn_id, request.ticket, open_store,
                                             request.objects)

    def _committed(self, request: CommittedRequest) -> None:
        """Register the partition with the materializer (a heap partition has none: the worker
        materializes it)."""
        if request.partition is None:
            return
        st = self.storage_for(request.store)
        self.materializer.register(request.store.key(), st.store, request.partition)

    def _materialization(self, request: MaterializationRequest) -> MaterializationReply:
        latest = self.materializer.latest(request.store.key(), request.log_id)
        m = latest.materialization
        return MaterializationReply(None if m is None else OfferedSnapshot(m.ref, m.boundary,
                                                                           m.chain),
                                    latest.failed)


def _listen(path: str) -> socket.socket:
    """A listening socket at ``path`` (mode 0600; a stale socket file is replaced)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        srv.bind(path)
    finally:
        os.umask(old)
    srv.listen(64)
    srv.settimeout(_POLL_S)
    return srv

