"""The upload adapter that plugs the executor agent into a worker's
:class:`~dstl.ChangelogStorage`: the storage's writers hand change sets to it as to their own
batching scheduler, and it sends them to the agent, which batches them with the other tasks of
the executor and answers once their segment is durable.

It implements the scheduler calls the storage makes (``upload``, ``available``,
``wait_available``, ``flush``, ``close``); the agent owns the flush window, limits and retries.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from dstl.options import DstlOptions
from dstl.scheduler import UploadTask
from dstl.spark.agent.client import AgentClient
from dstl.spark.agent.protocol import PersistReply, PersistRequest, StoreRef

__all__ = ["AgentUploadScheduler"]


class AgentUploadScheduler:
    """The writer-facing scheduler of a worker in agent mode: sends each upload task to the
    agent and resolves it on the reply (a failed request fails the task with the agent's
    error, or :class:`~dstl.spark.agent.protocol.AgentUnavailableError`)."""

    def __init__(self, client: AgentClient, uri: str, storage_options: dict[str, Any] | None,
                 options: DstlOptions) -> None:
        self._client = client
        self._store = StoreRef(uri, storage_options, options)

    def upload(self, task: UploadTask) -> None:
        if not task.change_sets:
            return
        sets = tuple(task.change_sets)
        fut = self._client.request(PersistRequest(self._store, sets))

        def done(f: Future[PersistReply]) -> None:
            exc = f.exception()
            if exc is not None:
                task.on_failure(task.change_sets, exc)
            else:
                task.on_success(f.result().change_set_refs(sets))

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
