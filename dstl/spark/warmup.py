"""Warming a query up before its first batch: Python workers, executor agents, restored tables.

Theory of operation
-------------------
The first batch after a restart pays for what a JVM-only operator never pays: the executor's
Python daemon and workers start and import DSTL, the executor agent is spawned, and then each
partition is restored from the store. Measured (``bench/restart.py``), the start-up dwarfs the
restore itself. :meth:`DstlStatefulOperator.warm_up` runs that work before the query starts, as
one small Spark job of ``partitions`` tasks, one per partition, spread over every executor core
(so the restores of an executor run in parallel in its workers, not one after another behind
the first task). The job has a batch's shape (routed rows, a ``repartitionById`` shuffle,
``mapInArrow``), so the session's shuffle and post-shuffle Arrow path are warm too:

* each task builds its worker's runtime (:func:`dstl.spark.runtime.runtime_for`: imports,
  agent spawn and connection, the agent's restore cache), and
* gets its partition's state at the *predicted base*: the newest checkpoint, i.e. the base of
  the next batch id, exactly as a batch task would (:func:`dstl.spark.slots.acquire`: hit, adopt,
  restore or new; downloads lease through the agent's cache, so an object is fetched once per
  executor however many tasks read it);
* with LMDB, after a complete restore of a partition's own handle (same layout), it writes the
  table marker of the base handle, then the table batch-id file: exactly what a batch task that
  committed the base checkpoint would have left on disk, so the first batch's task **adopts**
  the table (any worker of the executor) or finds it a **hit** (the same worker), reading
  nothing from the store. Heap tables stay in the worker that restored them (a hit if the batch
  lands on it; another worker restores as without a warm-up).

Why this is safe (every case ends in an ordinary restore, never in a wrong table):

* *Interrupted.* The batch-id file is removed before anything is restored, the restore removes
  the table marker first (:mod:`restore.file_restore`), and the marker is written only after the
  restore returned. Adopting needs both the batch-id file and a marker naming the base handle;
  a warm-up killed at any point leaves at most a table without one of them, which the next task
  clears and restores.
* *Predicted wrong.* If the first batch's base is another checkpoint (a re-run of a batch whose
  checkpoint completed, or a checkpoint written in between), the batch-id file or the marker
  (which names the checkpoint *and* its last change set) does not match, and the task restores.
  If a partition lands on another executor than its warm-up task, that executor restores it as
  usual; the warmed table stays unused on the first one until a later task there finds it not
  at its base (and clears it) — or exactly at its base, which is then the right state.
* *Rescaling.* When the partitioning changed, nothing is restored ahead (no marker could name
  the merged state); the tasks still warm their workers and agents.

A warm-up that fails (a bad object, a lost executor) does not fail the query: the error is
logged and returned, and the first batch restores (and raises) as it would have.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Iterator
from typing import Any

from dstl.spark.arrow_build import to_array
from dstl.spark.config import OperatorConfig, TaskInput
from dstl.spark.runtime import WorkerRuntime, runtime_for
from dstl.spark.slots import acquire
from materializer.handles import ChangelogStateBackendHandle

__all__ = ["WARM_UP_SCHEMA", "warm_partition", "pre_restore"]

#: The warm-up job's one row per task.
WARM_UP_SCHEMA = "partition int, outcome string"


def warm_partition(cfg: OperatorConfig, task_input: TaskInput, batches: Iterable[Any],
                   partition: int | None = None) -> Iterator[Any]:
    """The body of one warm-up task (see the module docstring): one row, the partition and a
    JSON outcome (``access``: how it got the state, ``marked``: whether the table is now
    adoptable, ``seconds``, ``daemon_preloaded``: whether this worker was forked by
    :mod:`dstl.spark.daemon` with DSTL imported)."""
    import pyarrow as pa

    from dstl.spark.daemon import PRELOADED
    from dstl.spark.task import _task_identity, check_version

    for _ in batches:  # the job's input only places the task; nothing to read
        pass
    check_version(task_input.driver_version)
    partition, _attempt = _task_identity(partition)
    started = time.monotonic()
    rt = runtime_for(cfg)
    runtime_s = time.monotonic() - started
    outcome = pre_restore(rt, partition, task_input)
    outcome.update(runtime_seconds=runtime_s, seconds=time.monotonic() - started,
                   daemon_preloaded="dstl.spark.task" in PRELOADED)
    yield pa.RecordBatch.from_arrays(
        [to_array([partition], pa.int32()), to_array([json.dumps(outcome)], pa.string())],
        schema=pa.schema([("partition", pa.int32()), ("outcome", pa.string())]))


def pre_restore(rt: WorkerRuntime, partition: int, task_input: TaskInput) -> dict[str, Any]:
    """Get the partition's state at ``task_input``'s base in this worker, as a batch task would,
    and leave an LMDB table adoptable (marker + batch-id file) when it holds exactly the
    partition's own base handle."""
    cfg = rt.cfg
    if not _same_layout(cfg, partition, task_input):
        return {"access": "skipped", "marked": False,
                "why": "the partitioning changed (rescale): restored by the batch"}
    with rt.lock:
        lmdb = cfg.table == "lmdb"
        if lmdb and rt.slots.get(partition) is None \
                and rt.read_table_batch_id(partition) != task_input.base_checkpoint:
            # not adoptable as it is: forget what the file says before the restore touches the
            # table, so a warm-up killed midway leaves nothing a task could adopt
            rt.write_table_batch_id(partition, None)
        try:
            _slot, access = acquire(rt, partition, task_input)
            # hit / adopt: the table is adoptable already (that is how it was found)
            marked = access.access in ("hit", "adopt")
            if lmdb and access.access == "restore":
                marked = _mark_at_base(rt, partition, task_input)
        except BaseException:
            rt.drop(partition)
            with contextlib.suppress(OSError):
                rt.write_table_batch_id(partition, None)
            raise
    return {"access": access.access, "marked": marked,
            "restore_seconds": access.restore_seconds,
            "restored_entries": access.restored_entries,
            "restored_changes": access.restored_changes}


def _same_layout(cfg: OperatorConfig, partition: int, task_input: TaskInput) -> bool:
    """Whether the partition's state is exactly its own base handle (or there is none)."""
    key_groups = cfg.key_groups(partition)
    raw = task_input.base_handles.get(partition)
    others = [p for p, j in task_input.base_handles.items() if p != partition
              and len(_handle(j, task_input, p).key_groups.intersection(key_groups))]
    if others:
        return False
    return raw is None or _handle(raw, task_input, partition).key_groups == key_groups


def _handle(raw: str, task_input: TaskInput, partition: int) -> ChangelogStateBackendHandle:
    return ChangelogStateBackendHandle.from_json(
        raw, key=f"checkpoint {task_input.base_checkpoint}: handle of partition {partition}")


def _mark_at_base(rt: WorkerRuntime, partition: int, task_input: TaskInput) -> bool:
    """Write the base handle's table marker (one LMDB transaction), then the batch-id file:
    what a task that committed the base would have left, so any worker adopts the table."""
    raw = task_input.base_handles.get(partition)
    if raw is None:
        return False
    backend = rt.slots[partition].backend
    with backend.write_batch():
        backend.write_table_marker(_handle(raw, task_input, partition))
    rt.write_table_batch_id(partition, task_input.base_checkpoint)
    return True
