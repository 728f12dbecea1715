"""The executor agent: one process per executor that group-commits the change sets of all the
executor's concurrent tasks into one segment per flush window ("batch per task manager"), owns
the executor's restore cache and materializes its LMDB partitions.

Theory of operation
-------------------
*Why a process.* A Python worker runs one task at a time and a partition does not stick to a
worker, so batching across an executor's tasks needs something that outlives workers and sees all
of them.

*Lifecycle* (:mod:`~dstl.spark.agent.spawn`). Workers find the agent through a private Unix
socket named after the executor-local agent directory; when none answers, the first worker to
take the directory's spawn lock starts one, detached, and the others wait for it. The agent
(:mod:`~dstl.spark.agent.server`, ``python -m dstl.spark.agent``) exits when the executor JVM
or its directory is gone, or when told to. If it dies, requests in flight fail with
:class:`AgentUnavailableError` (the task fails and Spark retries it; nothing acknowledged is
lost, because the agent answers only once a segment is durable) and the next worker starts a new
one.

*Protocol* (:mod:`~dstl.spark.agent.protocol`). Length-prefixed frames of a JSON header and a
raw body, one typed request and reply per op, errors sent by type name and raised again as the
same DSTL type (:func:`encode_error` / :func:`decode_error`). The ops: ``persist`` (one writer's
change sets, answered with their segment references once durable), ``lease`` / ``release`` /
``cache_stats`` (the restore cache), ``committed`` (a task committed its partition's table: the
materializer schedules it) and ``materialization`` (a partition's newest snapshot, which the task
installs before it checkpoints), ``metrics``, ``ping``, ``shutdown``.

*Worker side.* :class:`AgentClient` (:mod:`~dstl.spark.agent.client`) is a worker's one
connection; :class:`AgentUploadScheduler` (:mod:`~dstl.spark.agent.uploader`) plugs it into the
worker's :class:`~dstl.ChangelogStorage` as its upload scheduler, and :class:`AgentCache`
(:mod:`~dstl.spark.agent.cache`) into restores as their cache.

*Agent side.* :class:`~dstl.spark.agent.server.AgentServer` serves the connections; the restore
cache (:class:`AgentCacheService`) and the materializer (:class:`AgentMaterializer`,
:mod:`~dstl.spark.agent.materializer`) are its parts.

*Ownership.* Segments written by the agent hold change sets of many workers, so no worker may
delete one: worker-side registries do not delete in agent mode; the checkpoint coordinator owns
what checkpoints reference, and its orphan collection removes what none ever referenced.
"""

from dstl.spark.agent.cache import AgentCache, AgentCacheService, AgentLease
from dstl.spark.agent.client import AgentClient
from dstl.spark.agent.materializer import AgentMaterializer, LatestMaterialization, PartitionSpec
from dstl.spark.agent.protocol import (
    AgentProtocolError,
    AgentUnavailableError,
    StoreRef,
    decode_error,
    encode_error,
)
from dstl.spark.agent.spawn import ensure_agent, executor_pid, socket_path
from dstl.spark.agent.uploader import AgentUploadScheduler

__all__ = ["AgentCache", "AgentCacheService", "AgentClient", "AgentLease", "AgentMaterializer",
           "AgentProtocolError", "AgentUnavailableError", "AgentUploadScheduler",
           "LatestMaterialization", "PartitionSpec", "StoreRef", "decode_error", "encode_error",
           "ensure_agent", "executor_pid", "socket_path"]
