"""The executor agent: one process per executor that group-commits the change sets of all the
executor's concurrent tasks into one segment per flush window ("batch per task manager").

Theory of operation
-------------------
*Why a process.* A Python worker runs one task at a time and a partition does not stick to a
worker, so batching across an executor's tasks needs something that outlives workers and sees all
of them.

*Lifecycle.* Workers find the agent through a Unix socket named after the executor-local agent
directory (``/tmp/dstl-<uid>/<hash>.sock``, see :func:`socket_path`; the directory is 0700, so
the socket is private to the application's user). When no agent answers, the first worker to take ``<dir>/spawn.lock`` (``flock``) starts one
with ``start_new_session=True`` — detached, so killing the worker (Spark kills failed workers with
SIGKILL) does not take it down — and the others wait for it on the lock. The agent holds
``<dir>/agent.lock`` for its whole life and exits when the process it watches (the executor JVM)
is gone, or when told to. If the agent dies, requests in flight fail with
:class:`AgentUnavailableError` (the task fails and Spark retries it; nothing acknowledged is lost,
because the agent only answers after the segment is durable) and the next worker starts a new one.

*Protocol.* Frames are ``u32 length | u32 header length | header JSON | body``. A ``persist``
request carries one writer's change sets (their metadata in the header, their bodies in the body),
the store URI and the DSTL options; the agent hands them to the batching scheduler of its
:class:`~dstl.ChangelogStorage` for that store — the same scheduler, limits and retries as in
process — and answers with one ``(segment key, offset, length)`` per change set once the segment
is durable. Errors come back with their DSTL type name and message and are raised as that type.
``metrics`` returns the agent's storage metrics; ``shutdown`` stops it. ``lease``, ``release``
and ``cache_stats`` serve the executor's restore cache, which the agent owns
(:mod:`dstl.spark.agent_cache`); a connection's leases are given back when it ends.
``committed`` (sent by a task after it committed its partition's table) registers the partition
with the agent's materializer (:mod:`dstl.spark.agent_materializer`) and answers with the
agent's metrics and last log lines; ``materialization`` answers with a partition's newest
snapshot for the task to install before it checkpoints.

*Ownership.* Segments written by the agent hold change sets of many workers, so no worker may
delete one: worker-side registries do not delete in agent mode; the checkpoint coordinator owns
what checkpoints reference, and its orphan collection removes what none ever referenced.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any

from dstl import errors as dstl_errors
from dstl.errors import DstlError, StorageError
from dstl.handle import ChangeSetRef
from dstl.options import DstlOptions
from dstl.scheduler import UploadTask
from dstl.segment import ChangeSet

__all__ = ["AgentClient", "AgentUnavailableError", "AgentUploadScheduler", "ensure_agent",
           "main"]

logger = logging.getLogger(__name__)

_FRAME = struct.Struct(">II")
_MAX_FRAME = 1 << 31
#: Unix socket paths are limited to 107 bytes; executor directories (YARN appcache,
#: SPARK_LOCAL_DIRS/blockmgr-<uuid>/...) are often longer, so the socket lives in a short private
#: directory and is named after a hash of the agent directory.
_SOCKET_ROOT = "/tmp"


def store_fields(uri: str, storage_options: dict[str, Any] | None,
                 options: DstlOptions) -> dict[str, Any]:
    """The request fields that name a store for the agent (it opens one storage per distinct
    triple and shares it between persists, leases and materializations)."""
    return {"uri": uri, "storage_options": storage_options,
            "options": {f: getattr(options, f) for f in options.__dataclass_fields__}}


def socket_path(directory: str) -> str:
    """The agent socket of an agent directory: ``/tmp/dstl-<uid>/<hash>.sock`` (dir 0700)."""
    import hashlib

    root = os.path.join(_SOCKET_ROOT, f"dstl-{os.getuid()}")
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.stat(root)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise AgentUnavailableError(f"{root} must belong to this user with mode 0700 (it holds "
                                    "the executor agent's socket); fix or remove it")
    digest = hashlib.sha256(os.path.realpath(directory).encode()).hexdigest()[:24]
    return os.path.join(root, f"{digest}.sock")


class AgentUnavailableError(StorageError):
    """The executor agent is not running or died while a request was in flight (retryable:
    the task fails and Spark retries it, which starts a new agent)."""


# --------------------------------------------------------------------------- framing


def _send(sock: socket.socket, header: dict[str, Any], body: bytes = b"") -> None:
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    sock.sendall(_FRAME.pack(4 + len(h) + len(body), len(h)) + h + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    total, hlen = _FRAME.unpack(_recv_exact(sock, 8))
    if total < 4 or hlen > total - 4 or total > _MAX_FRAME:
        raise ConnectionError(f"malformed frame (length {total}, header {hlen})")
    payload = _recv_exact(sock, total - 4)
    header = json.loads(payload[:hlen].decode("utf-8"))
    if not isinstance(header, dict):
        raise ConnectionError("malformed frame header")
    return header, payload[hlen:]


def _error_from(reply: dict[str, Any]) -> BaseException:
    cls = getattr(dstl_errors, str(reply.get("error_type")), None)
    msg = f"executor agent: {reply.get('message')}"
    sent = reply.get("attrs")
    attrs: dict[str, Any] = sent if isinstance(sent, dict) else {}
    exc: BaseException
    if isinstance(cls, type) and issubclass(cls, StorageError):
        exc = cls(msg, key=reply.get("key"))
    elif isinstance(cls, type) and issubclass(cls, dstl_errors.ClosedError):
        exc = cls(msg)
    elif isinstance(cls, type) and issubclass(cls, DstlError):
        # constructors differ (CorruptObjectError takes key, offset, reason): build the error
        # with the agent's message and the attributes it sent, so callers keep type and fields
        exc = cls.__new__(cls)
        DstlError.__init__(exc, msg)
        if isinstance(exc, dstl_errors.CorruptObjectError):
            exc.key, exc.offset, exc.reason = str(reply.get("key") or "?"), 0, msg
    else:
        return StorageError(msg)
    exc.__dict__.update({k: v for k, v in attrs.items() if isinstance(k, str)})
    return exc


def _error_reply(exc: BaseException) -> dict[str, Any]:
    """A failure as a reply that :func:`_error_from` raises again as the same type, with its
    message and its plain attributes (key, offset, reason, ...)."""
    if not isinstance(exc, DstlError):
        return {"ok": False, "error_type": "StorageError",
                "message": f"{type(exc).__name__}: {exc}", "key": None}
    attrs = {k: v for k, v in vars(exc).items()
             if v is None or isinstance(v, (str, int, float, bool))}
    return {"ok": False, "error_type": type(exc).__name__, "message": str(exc),
            "key": getattr(exc, "key", None), "attrs": attrs}


# --------------------------------------------------------------------------- agent (server)


class _Agent:
    def __init__(self, directory: str, watch_pid: int | None) -> None:
        self.directory = directory
        self.watch_pid = watch_pid
        self.storages: dict[str, Any] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.requests = 0
        self.connections = 0
        self.cache_service: Any = None  # AgentCacheService, see restore_cache()
        from dstl.spark.agent_materializer import AgentMaterializer
        self.materializer = AgentMaterializer()
        self.conn_ids = itertools.count(1)  # names a connection's cache leases; never reused

    @staticmethod
    def storage_key(header: dict[str, Any]) -> str:
        """Names the store of a request (see :func:`store_fields`)."""
        return json.dumps([header["uri"], header.get("storage_options"),
                           header.get("options") or {}], sort_keys=True, default=str)

    def storage_for(self, uri: str, storage_options: dict[str, Any] | None,
                    options: dict[str, Any]) -> Any:
        from dstl.storage import ChangelogStorage

        key = self.storage_key({"uri": uri, "storage_options": storage_options,
                                "options": options})
        with self.lock:
            st = self.storages.get(key)
            if st is None:
                st = ChangelogStorage(uri, options=DstlOptions(**options),
                                      storage_options=storage_options)
                st.registry.deletes_enabled = False  # shared segments: never deleted here
                self.storages[key] = st
            return st

    def restore_cache(self) -> Any:
        """The executor's restore cache (``<directory>/cache``), opened on first use.

        Raises:
            ClosedError: the agent is stopping.
            CacheError: the cache directory cannot be used.
        """
        from dstl.spark.agent_cache import AgentCacheService

        with self.lock:
            if self.cache_service is None:
                if self.stop.is_set():
                    raise dstl_errors.ClosedError("the executor agent's restore cache",
                                                  "the agent is stopping; the task is retried")
                self.cache_service = AgentCacheService(self.directory)
            return self.cache_service

    def serve(self) -> None:
        path = socket_path(self.directory)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            srv.bind(path)
        finally:
            os.umask(old)
        srv.listen(64)
        srv.settimeout(0.5)
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
                self.connections += 1
                threading.Thread(target=self._connection, args=(conn,),
                                 name="dstl-agent-conn", daemon=True).start()
        finally:
            srv.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            self.materializer.close()  # finishes the snapshot in progress; before the storages
            with self.lock:
                cache, self.cache_service = self.cache_service, None
            if cache is not None:  # before the storages: its downloads use them
                cache.close()
            for st in list(self.storages.values()):
                st.close()
            logger.info("dstl agent %d stopped", os.getpid())

    def _watch(self) -> None:
        while not self.stop.wait(0.5):
            if self.watch_pid is not None and not _alive(self.watch_pid):
                logger.info("executor process %d is gone; agent exits", self.watch_pid)
                self.stop.set()
            elif not os.path.isdir(self.directory):
                # SPARK_LOCAL_DIRS is removed when the executor (or local SparkContext) stops
                logger.info("agent directory %s is gone; agent exits", self.directory)
                self.stop.set()

    def _connection(self, conn: socket.socket) -> None:
        send_lock = threading.Lock()
        conn_id = next(self.conn_ids)

        def reply(header: dict[str, Any]) -> None:
            with send_lock, contextlib.suppress(OSError):
                _send(conn, header)

        try:
            while not self.stop.is_set():
                try:
                    header, body = _recv(conn)
                except (ConnectionError, OSError):
                    return
                self.requests += 1
                rid = header.get("id")
                op = header.get("op")
                try:
                    if op == "persist":
                        self._persist(header, body, lambda h, r=rid: reply({"id": r, **h}))
                    elif op == "metrics":
                        reply({"id": rid, "ok": True, "metrics": self.metrics(),
                               "log_tail": self.log_tail()})
                    elif op == "ping":
                        reply({"id": rid, "ok": True, "pid": os.getpid()})
                    elif op == "shutdown":
                        reply({"id": rid, "ok": True})
                        self.stop.set()
                    elif op == "lease":  # runs on the cache's threads: downloads take time
                        self._lease(conn_id, header, lambda h, r=rid: reply({"id": r, **h}))
                    elif op == "release":
                        self.restore_cache().release(conn_id, int(header.get("lease", -1)))
                        reply({"id": rid, "ok": True})
                    elif op == "cache_stats":
                        reply({"id": rid, "ok": True, "stats": self.restore_cache().stats()})
                    elif op == "committed":
                        self._committed(header)
                        reply({"id": rid, "ok": True, "metrics": self.metrics(),
                               "log_tail": self.log_tail()})
                    elif op == "materialization":
                        reply({"id": rid, "ok": True, **self.materializer.latest(
                            self.storage_key(header), str(header.get("log_id")))})
                    else:
                        reply({"id": rid, "ok": False, "error_type": "UsageError",
                               "message": f"unknown op {op!r}"})
                except DstlError as exc:
                    reply({"id": rid, **_error_reply(exc)})
        finally:
            # a worker that exited or was SIGKILLed must not pin cached files
            cache = self.cache_service
            if cache is not None:
                cache.release_connection(conn_id)
            conn.close()

    def _committed(self, header: dict[str, Any]) -> None:
        from dstl.spark.agent_materializer import PartitionSpec

        part = header.get("partition")
        if part is None:  # a heap partition: the worker materializes it
            return
        try:
            spec = PartitionSpec.from_json_obj(part)
        except (KeyError, TypeError, ValueError, DstlError) as exc:
            raise dstl_errors.UsageError(f"malformed partition registration {part!r}: "
                                         f"{exc}") from exc
        st = self.storage_for(header["uri"], header.get("storage_options"),
                              header.get("options") or {})
        self.materializer.register(self.storage_key(header), st.store, spec)

    def _lease(self, conn_id: int, header: dict[str, Any], reply: Any) -> None:
        def open_store() -> Any:  # on the cache's thread: opening a store may talk to it
            return self.storage_for(header["uri"], header.get("storage_options"),
                                    header.get("options") or {}).store

        def done(f: Future[dict[str, Any]]) -> None:
            if f.cancelled():  # the cache closed before the request ran
                reply(_error_reply(dstl_errors.ClosedError(
                    "the executor agent's restore cache", "the agent is stopping; the task is "
                                                          "retried")))
                return
            exc = f.exception()
            reply(_error_reply(exc) if exc is not None else {"ok": True, **f.result()})

        fut = self.restore_cache().submit_lease(conn_id, open_store, header.get("key"),
                                                header.get("verify"), header.get("size_hint"))
        fut.add_done_callback(done)

    def _persist(self, header: dict[str, Any], body: bytes, reply: Any) -> None:
        st = self.storage_for(header["uri"], header.get("storage_options"),
                              header.get("options") or {})
        sets: list[ChangeSet] = []
        pos = 0
        for m in header["sets"]:
            n = int(m["size"])
            sets.append(ChangeSet(m["log_id"], int(m["sqn"]), body[pos:pos + n],
                                  int(m["change_count"]), int(m["payload_bytes"]),
                                  int(m["kg_min"]), int(m["kg_max"])))
            pos += n

        def ok(pairs: list[tuple[ChangeSet, ChangeSetRef]]) -> None:
            reply({"ok": True, "refs": [[r.key, r.offset, r.length] for _, r in pairs]})

        def failed(_: list[ChangeSet], exc: BaseException) -> None:
            reply(_error_reply(exc))

        st.scheduler.upload(UploadTask(sets, ok, failed))

    def log_tail(self, lines: int = 5) -> list[str]:
        """The agent's last log lines (the driver shows them with each batch)."""
        try:
            with open(os.path.join(self.directory, "agent.log"), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                return f.read().decode("utf-8", "replace").splitlines()[-lines:]
        except OSError:
            return []

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"agent.pid": float(os.getpid()),
                                 "agent.requests": float(self.requests),
                                 "agent.connections": float(self.connections)}
        for st in list(self.storages.values()):
            for k, v in st.metrics().items():
                out[f"agent.{k}"] = out.get(f"agent.{k}", 0.0) + v
        cache = self.cache_service
        if cache is not None:
            out.update({f"agent.cache.{k}": float(v) for k, v in cache.stats().items()})
        out.update({f"agent.{k}": v for k, v in self.materializer.metrics().items()})
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m dstl.spark.agent --dir DIR [--watch-pid PID]``."""
    p = argparse.ArgumentParser(prog="dstl-agent")
    p.add_argument("--dir", required=True)
    p.add_argument("--watch-pid", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        filename=os.path.join(args.dir, "agent.log"))
    lock = open(os.path.join(args.dir, "agent.lock"), "w")  # noqa: SIM115 - held for life
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        logger.info("another agent holds %s; exiting", lock.name)
        return 0
    _Agent(args.dir, args.watch_pid).serve()
    return 0


# --------------------------------------------------------------------------- worker side


def executor_pid() -> int | None:
    """The executor JVM's pid seen from a Python worker (worker -> daemon -> JVM)."""
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            daemon_parent = int(f.read().rsplit(")", 1)[1].split()[1])
        return daemon_parent if daemon_parent > 1 else None
    except (OSError, ValueError, IndexError):
        return None


def ensure_agent(directory: str, watch_pid: int | None, timeout_s: float = 30.0) -> str:
    """Return the agent's socket path, starting the agent if none answers.

    Raises:
        AgentUnavailableError: no agent could be started within ``timeout_s``.
    """
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    path = socket_path(directory)
    if _ping(path):
        return path
    with open(os.path.join(directory, "spawn.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one spawner; the others wait here, then find it
        try:
            if _ping(path):
                return path
            cmd = [sys.executable, "-m", "dstl.spark.agent", "--dir", directory]
            if watch_pid is not None:
                cmd += ["--watch-pid", str(watch_pid)]
            err_path = os.path.join(directory, "agent.err")
            with open(err_path, "ab") as err:  # start-up failures land here, not in the void
                subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                 stdout=err, stderr=err, close_fds=True)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if _ping(path):
                    return path
                time.sleep(0.05)  # polling a process we just started; no event to wait on
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    tail = ""
    with contextlib.suppress(OSError), open(os.path.join(directory, "agent.err"), "rb") as f:
        tail = f.read()[-800:].decode("utf-8", "replace").strip()
    raise AgentUnavailableError(f"the executor agent did not start within {timeout_s}s (see "
                                f"{directory}/agent.log and agent.err){': ' + tail if tail else ''}")


def _ping(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(path)
            _send(s, {"id": 0, "op": "ping"})
            header, _ = _recv(s)
            return bool(header.get("ok"))
    except (OSError, ConnectionError, ValueError):
        return False


class AgentClient:
    """One connection from a worker process to its executor's agent; thread-safe.

    Replies are matched to requests by id on the ``dstl-agent-client`` reader thread; if the
    connection breaks, every request in flight fails with :class:`AgentUnavailableError`.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise AgentUnavailableError(f"cannot reach the executor agent at {path}: "
                                        f"{exc}") from exc
        self._lock = threading.Lock()
        self._pending: dict[int, Future[dict[str, Any]]] = {}
        self._next = 1
        self._broken: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name="dstl-agent-client",
                                        daemon=True)
        self._reader.start()

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def request(self, header: dict[str, Any], body: bytes = b"") -> Future[dict[str, Any]]:
        fut: Future[dict[str, Any]] = Future()
        with self._lock:
            if self._broken is not None:
                raise AgentUnavailableError(f"executor agent connection lost: {self._broken}")
            rid = self._next
            self._next += 1
            self._pending[rid] = fut
            try:
                _send(self._sock, {"id": rid, **header}, body)
            except OSError as exc:
                del self._pending[rid]
                self._broken = exc
                raise AgentUnavailableError(f"executor agent connection lost: {exc}") from exc
        return fut

    def _read(self) -> None:
        try:
            while True:
                header, _ = _recv(self._sock)
                with self._lock:
                    fut = self._pending.pop(int(header.get("id", -1)), None)
                if fut is not None:
                    fut.set_result(header)
        except (ConnectionError, OSError, ValueError) as exc:
            with self._lock:
                self._broken = exc
                pending, self._pending = self._pending, {}
            for fut in pending.values():
                fut.set_exception(AgentUnavailableError(
                    f"the executor agent went away while a request was in flight ({exc}); "
                    "the task fails and Spark retries it"))

    def metrics(self, timeout_s: float = 10.0) -> dict[str, float]:
        """The agent's storage metrics (``agent.*``)."""
        return dict(self.status(timeout_s).get("metrics") or {})

    def status(self, timeout_s: float = 10.0) -> dict[str, Any]:
        """The agent's metrics and its last log lines."""
        return self.request({"op": "metrics"}).result(timeout_s)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._reader.join(timeout=5)


class AgentUploadScheduler:
    """The writer-facing scheduler of a worker in agent mode: sends each upload task to the
    agent (which batches it with the other tasks of the executor) and resolves it on reply."""

    def __init__(self, client: AgentClient, uri: str, storage_options: dict[str, Any] | None,
                 options: DstlOptions) -> None:
        self._client = client
        self._store = store_fields(uri, storage_options, options)

    def upload(self, task: UploadTask) -> None:
        if not task.change_sets:
            return
        meta = [{"log_id": cs.log_id, "sqn": cs.sqn, "size": len(cs.body),
                 "change_count": cs.change_count, "payload_bytes": cs.payload_bytes,
                 "kg_min": cs.kg_min, "kg_max": cs.kg_max} for cs in task.change_sets]
        fut = self._client.request({"op": "persist", **self._store, "sets": meta},
                                   b"".join(cs.body for cs in task.change_sets))

        def done(f: Future[dict[str, Any]]) -> None:
            exc = f.exception()
            if exc is None:
                reply = f.result()
                if reply.get("ok"):
                    pairs = [(cs, ChangeSetRef(cs.sqn, key, off, length, cs.change_count,
                                               cs.payload_bytes))
                             for cs, (key, off, length) in zip(task.change_sets, reply["refs"])]
                    task.on_success(pairs)
                    return
                exc = _error_from(reply)
            task.on_failure(task.change_sets, exc)

        fut.add_done_callback(done)

    # the storage's other scheduler calls
    def available(self) -> bool:
        return not self._client.broken

    def wait_available(self, timeout_s: float | None = None) -> bool:
        return self.available()

    def flush(self) -> None:
        """The agent owns the flush window."""

    def close(self, timeout_s: float | None = None) -> None:
        """Requests in flight resolve through the client; nothing to stop here."""


if __name__ == "__main__":
    sys.exit(main())
