"""Executor side of the Spark operator: what one ``mapInArrow`` task does.

Theory of operation
-------------------
A Python worker keeps module-level objects between tasks, but a partition does not stick to a
worker (reference: spark_state.md §4). So each worker process holds a :class:`_Runtime` per
operator (one :class:`~dstl.ChangelogStorage`, one restore cache, the partitions it served), and
each task first makes sure its partition's state is exactly the state after the last committed
checkpoint (``base``), in one of three ways:

1. **hit** — this process served the partition in the base checkpoint and (LMDB) no other worker
   advanced the shared on-disk table since: its backend is current;
   tell it the base completed (hands the log over, unblocks materialization).
2. **adopt** — LMDB only: another worker of this executor served it and the partition's local
   version file says the on-disk table is at the base: open the table and install the base
   checkpoint's handle as the log base, without reading anything.
3. **restore** — anything else (the partition moved, the worker was replaced, a batch is
   re-run, the version is unknown): clear the local table and restore from the base manifest
   (snapshot + log replay through the cache).

Then the task groups its rows by key, calls the processor, checkpoints (``snapshot(batch_id)``:
waits only for the log of this batch to be durable), writes the partition's version file, and
returns its output rows plus one metadata row carrying the backend handle for the driver's
coordinator. With LMDB all of that happens inside one write transaction, which also holds the
table marker of the checkpoint (:mod:`materializer.table_marker`) and commits only once the log is
durable. Any failure discards the partition's in-process backend and version, so a retry
restores: state is never half-applied.

With the executor agent (the default), a task's change sets go to the agent, which writes the
change sets of all of the executor's concurrent tasks into one segment per flush window; restores
read through the agent's cache; and LMDB partitions are materialized by the agent, from a read
transaction, while workers keep writing: before it checkpoints, a task installs the newest
snapshot the agent took of its partition (if its log reaches the snapshot's boundary), and after
it commits, it registers the partition's new marker with the agent. The heap table, and every
table with ``agent=False``, materializes in the task, synchronously when due; with ``agent=False``
each task also writes its own segment.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dstl.errors import BackendFailedError
from dstl.keygroups import KeyGroupRange
from dstl.layout import operator_dir
from dstl.options import DstlOptions
from dstl.spark.agent import (
    AgentCache,
    AgentClient,
    AgentUploadScheduler,
    PartitionSpec,
    StoreRef,
    ensure_agent,
    executor_pid,
)
from dstl.spark.agent.protocol import CommittedRequest, MaterializationRequest
from dstl.storage import ChangelogStorage
from materializer.backend import ChangelogKeyedStateBackend
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.options import BackendOptions
from materializer.table_marker import TableMarker
from restore.cache import LocalFileCache
from restore.restore import RestoreStats, restore_backend

__all__ = ["META_COLUMN", "OperatorConfig", "TaskInput", "run_partition"]

logger = logging.getLogger(__name__)

META_COLUMN = "_dstl_meta"


@dataclass(frozen=True)
class OperatorConfig:
    """Everything a task needs to know about the operator (shipped with the task closure)."""

    name: str
    processor: Any  # the StatefulProcessor class (cloudpickled)
    key_column: str
    output_columns: tuple[str, ...]
    arrow_schema: Any  # pyarrow schema of the output columns + the metadata column
    state_uri: str
    storage_options: dict[str, Any] | None
    partitions: int
    max_parallelism: int
    table: str
    dstl_options: DstlOptions
    backend_options: BackendOptions
    materialization_interval_s: float
    local_dir: str | None = None
    agent: bool = True


@dataclass(frozen=True)
class TaskInput:
    """What changes per micro-batch."""

    batch_id: int
    base_checkpoint: int  # -1: empty state
    base_handles: dict[int, str] = field(default_factory=dict)  # partition -> handle JSON
    retained: tuple[int, ...] = ()


@dataclass
class _Slot:
    backend: ChangelogKeyedStateBackend
    processor: Any
    version: int
    last_materialized_s: float


class _Runtime:
    """Per process and operator: storage, cache, and the partitions served here."""

    def __init__(self, cfg: OperatorConfig) -> None:
        self.cfg = cfg
        self.pid = os.getpid()
        executor_dir = (os.environ.get("SPARK_LOCAL_DIRS") or tempfile.gettempdir()).split(",")[0]
        self.agent: AgentClient | None = None
        uploader = None
        if cfg.agent:
            # the agent lives in the executor's own directory: it goes away with the executor
            path = ensure_agent(os.path.join(executor_dir, "dstl-agent"), executor_pid())
            self.agent = AgentClient(path)
            uploader = AgentUploadScheduler(self.agent, cfg.state_uri, cfg.storage_options,
                                            cfg.dstl_options)
        self.storage = ChangelogStorage(cfg.state_uri, options=cfg.dstl_options,
                                        storage_options=cfg.storage_options, uploader=uploader)
        base = cfg.local_dir or executor_dir
        self.local_dir = os.path.join(base, "dstl", operator_dir(cfg.name))
        os.makedirs(self.local_dir, exist_ok=True)
        self.cache: AgentCache | LocalFileCache
        if self.agent is not None:
            # the executor's one cache lives in the agent: an object is downloaded once per
            # executor, and a killed worker leaves no files and no leases behind
            self.cache = AgentCache(self.agent, cfg.state_uri, cfg.storage_options,
                                    cfg.dstl_options)
        else:
            self.cache = LocalFileCache(os.path.join(self.local_dir, f"cache-{self.pid}"))
        self.slots: dict[int, _Slot] = {}
        self.lock = threading.Lock()

    def version_path(self, partition: int) -> str:
        return os.path.join(self.local_dir, f"p{partition}.version")

    def read_version(self, partition: int) -> int | None:
        try:
            with open(self.version_path(partition)) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            return None

    def write_version(self, partition: int, version: int | None) -> None:
        path = self.version_path(partition)
        if version is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            return
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(str(version))
        os.replace(tmp, path)

    def drop(self, partition: int) -> None:
        slot = self.slots.pop(partition, None)
        if slot is not None:
            _close_quietly(slot)

    def close(self) -> None:
        for partition in list(self.slots):
            self.drop(partition)
        self.storage.close()
        self.cache.close()
        if self.agent is not None:
            self.agent.close()


_RUNTIMES: dict[tuple[str, str], _Runtime] = {}
_RUNTIMES_LOCK = threading.Lock()


def _runtime(cfg: OperatorConfig) -> _Runtime:
    key = (cfg.state_uri, cfg.name)
    with _RUNTIMES_LOCK:
        rt = _RUNTIMES.get(key)
        if rt is not None and rt.pid == os.getpid() and rt.agent is not None and rt.agent.broken:
            # the agent died: this process's writers can no longer upload; start over (the
            # partitions restore from their last checkpoint)
            logger.warning("executor agent connection lost; resetting DSTL runtime %s", key)
            rt.close()
            rt = None
        if rt is None or rt.pid != os.getpid():  # never reuse across fork
            rt = _RUNTIMES[key] = _Runtime(cfg)
        return rt


def _close_quietly(slot: _Slot) -> None:
    try:
        close = getattr(slot.processor, "close", None)
        if close is not None:
            close()
    finally:
        slot.backend.close()


def _agent_materializes(cfg: OperatorConfig) -> bool:
    """The executor agent materializes LMDB partitions (a heap lives in one worker's memory)."""
    return cfg.agent and cfg.table == "lmdb"


def _backend_options(cfg: OperatorConfig) -> BackendOptions:
    if _agent_materializes(cfg):  # no timer, no size trigger: the agent decides
        return cfg.backend_options.replace(materialization_interval_s=None,
                                           materialize_log_ratio=None)
    return cfg.backend_options


def _key_groups(cfg: OperatorConfig, partition: int) -> KeyGroupRange:
    return KeyGroupRange.of_operator(cfg.max_parallelism, cfg.partitions, partition)


def _operator_id(cfg: OperatorConfig, partition: int) -> str:
    return f"{cfg.name}/p{partition}"


def _acquire(rt: _Runtime, partition: int, inp: TaskInput, stats: dict[str, Any]) -> _Slot:
    """The partition's backend, at exactly the base checkpoint's state."""
    cfg = rt.cfg
    from dstl.spark.processor import StatefulProcessorHandle

    slot = rt.slots.get(partition)
    # An LMDB table is shared on disk by every worker of the executor: this worker's backend is
    # current only if no other worker has written the table since (the version file says which
    # batch the table holds, the table marker which attempt of it).
    if slot is not None and slot.version == inp.base_checkpoint and (
            cfg.table != "lmdb" or (rt.read_version(partition) == inp.base_checkpoint
                                    and _holds_base(slot.backend, inp, partition))):
        stats["access"] = "hit"
        if inp.base_checkpoint >= 0:
            slot.backend.notify_checkpoint_complete(inp.base_checkpoint)
            if inp.retained:
                # checkpoints the coordinator no longer retains: their log may be truncated
                old = [c for c in slot.backend.checkpoint_ids() if c < min(inp.retained)]
                if old:
                    slot.backend.notify_checkpoint_subsumed(max(old))
        return slot
    rt.drop(partition)
    kgs = _key_groups(cfg, partition)
    op_id = _operator_id(cfg, partition)
    # every base handle whose key groups meet ours (several or partial ones after a change of
    # `partitions`: rescaling)
    handles = [h for h in (ChangelogStateBackendHandle.from_json(j)
                           for j in inp.base_handles.values())
               if len(h.key_groups.intersection(kgs))]
    same_layout = len(handles) == 1 and handles[0].key_groups == kgs
    t0 = time.monotonic()
    local_version = rt.read_version(partition) if cfg.table == "lmdb" else None
    backend: ChangelogKeyedStateBackend | None = None
    if not handles:
        # no state yet (first batch, or a partition that never had a checkpoint)
        backend = ChangelogKeyedStateBackend(rt.storage, op_id, kgs, cfg.max_parallelism,
                                             table=cfg.table, options=_backend_options(cfg),
                                             local_directory=rt.local_dir, clear_local=True)
        stats["access"] = "new"
    elif same_layout and local_version is not None and local_version == inp.base_checkpoint:
        backend = _adopt(rt, op_id, kgs, handles[0])
        if backend is not None:
            stats["access"] = "adopt"
    if backend is None:
        rs = RestoreStats()
        backend = restore_backend(handles, rt.storage, kgs, table=cfg.table,
                                  cache=rt.cache, operator_id=op_id,
                                  max_parallelism=cfg.max_parallelism,
                                  options=_backend_options(cfg), local_directory=rt.local_dir,
                                  stats=rs)
        stats["access"] = "restore" if same_layout else "rescale"
        stats["restore_changes"] = rs.get("changes", 0)
        stats["restore_entries"] = rs.get("entries", 0)
    stats["restore_seconds"] = time.monotonic() - t0
    processor = cfg.processor()
    processor.init(StatefulProcessorHandle(backend))
    slot = _Slot(backend, processor, inp.base_checkpoint, time.monotonic())
    rt.slots[partition] = slot
    return slot


def _marker(backend: ChangelogKeyedStateBackend) -> TableMarker | None:
    raw = backend.tables.read_marker()
    return None if raw is None else TableMarker.from_bytes(
        raw, where=f"{backend.tables.path} (table marker)")


def _holds_base(backend: ChangelogKeyedStateBackend, inp: TaskInput, partition: int) -> bool:
    """Whether the partition's on-disk table holds exactly the base checkpoint."""
    h = inp.base_handles.get(partition)
    marker = _marker(backend)
    return h is not None and marker is not None and marker.holds(
        ChangelogStateBackendHandle.from_json(h))


def _adopt(rt: _Runtime, op_id: str, kgs: KeyGroupRange, h: ChangelogStateBackendHandle
           ) -> ChangelogKeyedStateBackend | None:
    """Open the partition's on-disk LMDB table (another worker of this executor wrote it) as
    checkpoint ``h`` without reading anything from the store — if its marker says it holds
    exactly ``h``; the state ids come from the marker. ``None``: restore instead."""
    cfg = rt.cfg
    backend = ChangelogKeyedStateBackend(rt.storage, op_id, kgs, cfg.max_parallelism,
                                         table=cfg.table, options=_backend_options(cfg),
                                         local_directory=rt.local_dir)
    try:
        marker = _marker(backend)
        if marker is None or not marker.holds(h):
            backend.close()
            return None
        backend.install_restored(h.materialized, h.non_materialized, h.materialization_id)
        for sid, m in marker.states.items():
            backend.register_restored_state(m, int(sid))
        return backend
    except BaseException:
        backend.close()
        raise


def _materialization_due(cfg: OperatorConfig, slot: _Slot) -> bool:
    if time.monotonic() - slot.last_materialized_s >= cfg.materialization_interval_s:
        return True
    m = slot.backend.metrics()
    prefix = f"ChangelogBackend.{slot.backend.operator_id}."
    log = m.get(prefix + "logBytesSinceMaterialization", 0.0)
    ratio = cfg.backend_options.materialize_log_ratio
    return ratio is not None and log > max(cfg.backend_options.materialize_min_log_bytes,
                                           ratio * m.get(prefix + "lastFullSizeOfMaterialization",
                                                         0.0))


#: The agent answers materializer requests from memory; beyond this it is taken as hung.
_AGENT_QUICK_TIMEOUT_S = 60.0


def _store_ref(cfg: OperatorConfig) -> StoreRef:
    return StoreRef(cfg.state_uri, cfg.storage_options, cfg.dstl_options)


def _install_agent_materialization(agent: AgentClient, cfg: OperatorConfig,
                                   backend: ChangelogKeyedStateBackend) -> SnapshotRef | None:
    """Install the newest snapshot the agent took of this partition, if the backend's log reaches
    it; returns it when installed.

    Raises:
        BackendFailedError: the agent's materializations of this partition failed too often.
    """
    reply = agent.call(MaterializationRequest(_store_ref(cfg), backend.operator_id),
                       _AGENT_QUICK_TIMEOUT_S)
    if reply.failed:
        raise BackendFailedError(f"backend {backend.operator_id!r} failed: the executor agent's "
                                 f"materializations of it failed more than max_failures="
                                 f"{cfg.backend_options.max_failures} times in a row (last: "
                                 f"{reply.failed}); see the agent's log, fix the cause and "
                                 "restart the query")
    if reply.snapshot is None:
        return None
    return backend.install_materialization(reply.snapshot.ref, reply.snapshot.boundary)


def _committed(agent: AgentClient, cfg: OperatorConfig, backend: ChangelogKeyedStateBackend,
               h: ChangelogStateBackendHandle) -> tuple[dict[str, float], tuple[str, ...]]:
    """Tell the agent the partition's table is committed (it schedules the partition's next
    materialization); returns the agent's metrics and last log lines."""
    spec: PartitionSpec | None = None
    if _agent_materializes(cfg):
        bo = cfg.backend_options
        marker = backend.table_marker(h)
        spec = PartitionSpec(
            backend.operator_id, backend.tables.path, backend.key_groups,
            cfg.materialization_interval_s, bo.materialize_log_ratio, bo.materialize_min_log_bytes,
            bo.zstd_level, bo.max_failures, marker.boundary, marker.log_bytes,
            marker.snapshot_bytes)
    reply = agent.call(CommittedRequest(_store_ref(cfg), spec), _AGENT_QUICK_TIMEOUT_S)
    return reply.metrics, reply.log_tail


def run_partition(cfg: OperatorConfig, inp: TaskInput, batches: Iterator[Any],
                  partition: int | None = None) -> Iterator[Any]:
    """The body of one ``mapInArrow`` task (see the module docstring); ``partition`` defaults
    to the Spark task's partition id."""
    import pyarrow as pa
    from pyspark import TaskContext

    ctx = TaskContext.get()
    if partition is None:
        partition = ctx.partitionId() if ctx is not None else 0
    attempt = ctx.attemptNumber() if ctx is not None else 0
    rt = _runtime(cfg)
    stats: dict[str, Any] = {"partition": partition, "attempt": attempt, "pid": os.getpid(),
                             "restore_seconds": 0.0}
    t0 = time.monotonic()
    with rt.lock:
        try:
            slot = _acquire(rt, partition, inp, stats)
            backend = slot.backend
            sqn0 = backend.writer.next_sqn()
            groups: dict[Any, list[dict[str, Any]]] = {}
            rows_in = 0
            for batch in batches:
                for row in batch.to_pylist():
                    groups.setdefault(row[cfg.key_column], []).append(row)
                    rows_in += 1
            outputs: list[dict[str, Any]] = []
            materialized: SnapshotRef | None = None
            materializing_agent = rt.agent if _agent_materializes(cfg) else None
            with backend.write_batch():
                for key, rows in groups.items():
                    backend.set_current_key(key if isinstance(key, (str, bytes)) else str(key))
                    outputs.extend(slot.processor.handle_input_rows(key, iter(rows)))
                t1 = time.monotonic()
                if materializing_agent is not None:
                    materialized = _install_agent_materialization(materializing_agent, cfg,
                                                                  backend)
                    h = backend.snapshot(inp.batch_id).result(timeout=300)
                    # commits with this batch's state: a read transaction sees both or neither
                    backend.write_table_marker(h)
            if materializing_agent is None:
                if _materialization_due(cfg, slot):
                    materialized = backend.materialize_now(timeout_s=300)
                    if materialized is not None:
                        slot.last_materialized_s = time.monotonic()
                h = backend.snapshot(inp.batch_id).result(timeout=300)
                if cfg.table == "lmdb":
                    backend.write_table_marker(h)  # lets another worker adopt without reads
            slot.version = inp.batch_id
            if cfg.table == "lmdb":
                rt.write_version(partition, inp.batch_id)
            t2 = time.monotonic()
        except BaseException:
            rt.drop(partition)
            rt.write_version(partition, None)
            raise
    # the segments this task's change sets went to (shared with other tasks under the agent)
    delta = backend.last_delta
    new_refs = [r for r in (delta.change_sets if delta is not None else ()) if r.sqn >= sqn0]
    stats.update({
        "rows_in": rows_in, "rows_out": len(outputs), "keys": len(groups),
        "process_seconds": t1 - t0, "commit_seconds": t2 - t1,
        "segment_keys": sorted({r.key for r in new_refs}),
        "bytes": sum(r.length for r in new_refs),
        "materializations": int(materialized is not None),
        "snapshot_bytes": materialized.size if materialized is not None else 0,
        "agent": None,
    })
    if rt.agent is not None:
        stats["agent"], log_tail = _committed(rt.agent, cfg, backend, h)
        stats["agent_log"] = list(log_tail)
    meta = {"partition": partition, "handle": h.to_json_obj(),
            "referenced_keys": h.referenced_keys(), "full_size": h.full_size,
            "incremental_size": h.incremental_size, "stats": stats}
    names = list(cfg.output_columns)
    cols: dict[str, list[Any]] = {n: [o.get(n) for o in outputs] for n in names}
    cols[META_COLUMN] = [None] * len(outputs)
    if outputs:
        yield pa.RecordBatch.from_pydict(cols, schema=cfg.arrow_schema)
    meta_cols: dict[str, list[Any]] = {n: [None] for n in names}
    meta_cols[META_COLUMN] = [json.dumps(meta)]
    yield pa.RecordBatch.from_pydict(meta_cols, schema=cfg.arrow_schema)
