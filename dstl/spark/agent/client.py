"""The worker side of the executor agent: one connection per worker process, typed requests,
replies matched by id.

Theory of operation
-------------------
A worker opens one :class:`AgentClient` per agent socket and shares it between its threads (the
upload scheduler's persists, the restore cache's leases, the task's materialization requests).
:meth:`AgentClient.request` sends a typed request (:mod:`dstl.spark.agent.protocol`) and returns
a future of its typed reply; the ``dstl-agent-client`` reader thread matches replies to requests
by id, decodes them with the request's own decoder, and raises failed requests as the DSTL error
the agent sent (:func:`~dstl.spark.agent.protocol.decode_error`).

Once the connection breaks — the agent died, or sent a frame that cannot be read — it stays
broken: every request in flight and every later one fails with
:class:`~dstl.spark.agent.protocol.AgentUnavailableError` (retryable: the task fails, Spark
retries it, and the next worker starts a new agent). Nothing acknowledged is lost, because the
agent answers a persist only once its segment is durable.

*A death between two tasks.* :attr:`AgentClient.broken` does not wait for the reader thread to
notice: it also asks the kernel (a zero-timeout ``poll``) whether the agent's end is closed. A
worker checks it before it reuses its runtime for a task, so a task never starts on the
connection of an agent that died after the previous task (it starts a new agent and restores
instead of failing at its first send). Nothing is ever sent again on a new connection: a request
that reached a dead agent may have had effects (a ``persist`` may have uploaded its segment; a
``committed`` registered a partition), and the writer has already failed that upload, so only a
whole new task attempt — from the base checkpoint, Spark's retry — is safe.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
from concurrent.futures import Future
from typing import Any, TypeVar

from dstl.spark.agent.protocol import (
    AgentProtocolError,
    AgentUnavailableError,
    ErrorReply,
    Header,
    MetricsReply,
    MetricsRequest,
    Reply,
    Request,
    decode_error,
    recv_frame,
    send_frame,
)

__all__ = ["AgentClient"]

R = TypeVar("R", bound=Reply)

#: How long a worker waits for a quick request (metrics) before taking the agent as hung.
DEFAULT_QUICK_TIMEOUT_S = 10.0
#: Poll events that mean the agent's end is gone (a reply waiting to be read is POLLIN only).
_PEER_GONE = select.POLLHUP | select.POLLERR | select.POLLNVAL | select.POLLRDHUP


class AgentClient:
    """One connection from a worker process to its executor's agent; thread-safe.

    Raises:
        AgentUnavailableError: (constructing) nothing listens on ``path``.
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
        self._pending: dict[int, tuple[Future[Any], Request[Any]]] = {}
        self._next_id = 1
        self._broken: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name="dstl-agent-client",
                                        daemon=True)
        self._reader.start()

    @property
    def broken(self) -> bool:
        """Whether the connection is lost (for good): the reader thread saw it end, a send
        failed, or the kernel already reports the agent's end closed.

        The last check is what a worker asks before it reuses its runtime for a task
        (:func:`dstl.spark.runtime.runtime_for`): the reader thread may not have run since the
        agent died (it also runs the callbacks of the futures it resolves), and a task that
        started on such a connection would fail at its first send ("Broken pipe").
        """
        if self._broken is not None:
            return True
        if not self._peer_closed():
            return False
        with self._lock:
            if self._broken is None:
                # sticky; the reader thread fails the requests in flight once it reads the end
                self._broken = ConnectionResetError("the executor agent closed the connection")
        return True

    def request(self, message: Request[R]) -> Future[R]:
        """Send ``message``; the future resolves to its reply, or fails with the error the agent
        sent (its DSTL type), :class:`AgentProtocolError` (a malformed reply) or
        :class:`AgentUnavailableError` (the connection broke).

        Raises:
            AgentUnavailableError: the connection is already broken, or breaks while sending.
        """
        header, body = message.encode()
        fut: Future[R] = Future()
        with self._lock:
            if self._broken is not None:
                raise AgentUnavailableError(f"executor agent connection lost: {self._broken}")
            request_id = self._next_id
            self._next_id += 1
            self._pending[request_id] = (fut, message)
            try:
                send_frame(self._sock, {"id": request_id, **header}, body)
            except OSError as exc:
                del self._pending[request_id]
                self._broken = exc
                raise AgentUnavailableError(f"executor agent connection lost: {exc}") from exc
        return fut

    def call(self, message: Request[R], timeout_s: float) -> R:
        """:meth:`request` and wait for the reply.

        Raises:
            AgentUnavailableError: no reply within ``timeout_s`` (the agent is taken as hung),
                or the connection broke.
            DstlError: the error the agent sent.
        """
        try:
            return self.request(message).result(timeout_s)
        except TimeoutError as exc:
            raise AgentUnavailableError(f"the executor agent did not answer {message.op!r} "
                                        f"within {timeout_s:g}s (hung?); the task fails and "
                                        "Spark retries it") from exc

    def status(self, timeout_s: float = DEFAULT_QUICK_TIMEOUT_S) -> MetricsReply:
        """The agent's metrics and its last log lines."""
        return self.call(MetricsRequest(), timeout_s)

    def metrics(self, timeout_s: float = DEFAULT_QUICK_TIMEOUT_S) -> dict[str, float]:
        """The agent's storage metrics (``agent.*``)."""
        return self.status(timeout_s).metrics

    def close(self) -> None:
        """Close the connection (requests in flight fail); the agent gives back its leases."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._reader.join(timeout=5)

    # ------------------------------------------------------------------ internals

    def _peer_closed(self) -> bool:
        """Whether the kernel reports the agent's end of the socket closed (or in error); a
        zero-timeout poll, which reads nothing (replies in flight stay for the reader thread)."""
        fd = self._sock.fileno()
        if fd < 0:  # closed by close()
            return True
        poller = select.poll()
        # POLLHUP and POLLERR are always reported; POLLRDHUP (Linux) is the peer's close alone
        poller.register(fd, select.POLLRDHUP)
        return any(events & _PEER_GONE for _, events in poller.poll(0))

    def _read(self) -> None:
        try:
            while True:
                header, _ = recv_frame(self._sock)
                self._resolve(header)
        except (OSError, AgentProtocolError) as exc:  # ConnectionError is an OSError
            with self._lock:
                self._broken = exc
                pending, self._pending = self._pending, {}
            for fut, _ in pending.values():
                fut.set_exception(AgentUnavailableError(
                    f"the executor agent went away while a request was in flight ({exc}); "
                    "the task fails and Spark retries it"))

    def _resolve(self, header: Header) -> None:
        """Complete the request a reply answers.

        Raises:
            AgentProtocolError: the reply answers no request in flight (the connection cannot be
                trusted any more).
        """
        request_id = header.get("id")
        with self._lock:
            entry = self._pending.pop(request_id, None) if isinstance(request_id, int) else None
        if entry is None:
            raise AgentProtocolError("reply", f"id {request_id!r} answers no request in flight")
        fut, message = entry
        try:
            if header.get("ok") is True:
                fut.set_result(message.decode_reply(header))
            else:
                fut.set_exception(decode_error(ErrorReply.decode(header)))
        except AgentProtocolError as exc:  # this reply only: the frame itself was sound
            fut.set_exception(exc)
