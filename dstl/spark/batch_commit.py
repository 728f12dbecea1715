"""A batch's checkpoint from its partitions' reports, and inside the query, after Spark's commit.

Theory of operation
-------------------
Both ways of running the operator end a batch the same way: every partition's report
acknowledges its backend handle to the driver's
:class:`~dstl.checkpoint.CheckpointCoordinator` (:func:`acknowledge`), and the last
acknowledgement writes the manifest for ``checkpoint_id = batch_id``. With ``foreach_batch``
that happens in the batch itself. Inside the query (``transform``) the tasks store their results
and the choice of the attempt Spark commits (:mod:`dstl.spark.query`); :class:`InQueryCommits`
writes the checkpoint of every batch whose choice is stored and whose manifest is not, oldest
first, when Spark reports a batch (:meth:`InQueryCommits.on_batch_committed`, from the query
listener) or when the operator starts again; then it forgets the protocol's objects below the
newest. Checkpoints are written one at a time (:attr:`InQueryCommits.lock`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dstl.checkpoint import CheckpointCoordinator, Completion
from dstl.spark.batch_record import BatchRecorder, BatchTimes, batch_stats
from dstl.spark.config import OperatorConfig
from dstl.spark.operator_checks import TimeSettings
from dstl.spark.query import PROCESSING_TIME_PROPERTY, WATERMARK_PROPERTY
from dstl.spark.report import TaskReport
from dstl.stores.base import BlobStore

__all__ = ["InQueryCommits", "Ready", "acknowledge"]


@dataclass(frozen=True)
class Ready:
    """What the operator opens once, before its first batch."""

    store: BlobStore
    coordinator: CheckpointCoordinator
    task_config: OperatorConfig
    out_schema: Any  # the Spark schema of the output rows
    static_conf: dict[str, str]  # spark.dstl.* of the SparkContext's conf (fixed for its life)
    conf: dict[str, str]  # spark.dstl.* in effect: the SparkContext's and the session's


def acknowledge(coordinator: CheckpointCoordinator, checkpoint_id: int, reports: list[TaskReport]
                 ) -> Completion | None:
    """Acknowledge every partition's handle; the completion (the manifest written) if the last
    acknowledgement completed the checkpoint."""
    completion = None
    for r in reports:
        h = r.handle
        completion = coordinator.acknowledge(checkpoint_id, f"p{r.partition}", h.to_json_obj(),
                                             h.referenced_keys(), h.full_size,
                                             h.incremental_size) or completion
    return completion


class InQueryCommits:
    """The checkpoints of :meth:`DstlStatefulOperator.transform
    <dstl.spark.operator.DstlStatefulOperator.transform>`'s batches (see the module docstring).

    Args:
        partitions: the operator's partitions.
        time: its time settings.
        recorder: where each batch's stats and progress go.
        ready: what the operator opened (``None`` before its first batch and after close).
    """

    def __init__(self, partitions: int, time: TimeSettings, recorder: BatchRecorder,
                 ready: Callable[[], Ready | None]) -> None:
        self._partitions = partitions
        self._time = time
        self._recorder = recorder
        self._ready = ready
        #: checkpoints of the query's batches are written one at a time
        self.lock = threading.Lock()

    def wait_for_checkpoint(self, batch_id: int, timeout_s: float = 60.0) -> bool:
        """Wait until the checkpoint of batch ``batch_id`` (or a later one) is written: inside
        the query the driver writes it when Spark reports the batch, on the listener's thread
        (e.g. ``op.wait_for_checkpoint(query.lastProgress["batchId"])`` after
        ``awaitTermination``, before reading the state). Whether it was written in time."""
        deadline = time.monotonic() + timeout_s
        while True:
            ready = self._ready()
            latest = ready.coordinator.latest() if ready is not None else None
            if latest is not None and latest.checkpoint_id >= batch_id:
                with self.lock:  # its progress is recorded too
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    def on_batch_committed(self, batch_id: int, query_id: str,
                           duration_ms: float = 0.0) -> None:
        """Spark committed micro-batch ``batch_id`` of query ``query_id``: if that query runs
        :meth:`transform`, write the checkpoints of the batch and of every earlier committed
        batch not written yet. Called by the query listener; idempotent."""
        from dstl.spark.query import choose, plan_of

        with self.lock:
            ready = self._ready()
            if ready is None:
                return
            latest = ready.coordinator.latest()
            if latest is not None and batch_id <= latest.checkpoint_id:
                return
            plan = plan_of(ready.store, batch_id)
            if plan is None or plan.query_id != query_id:
                return  # another query's batch, or no state task of this operator ran in it
            if choose(ready.store, batch_id, self._partitions, delay_ms=self._time.delay_ms,
                      event_time=self._time.event_time_column is not None) is None:
                return  # no state task of this operator ran in that batch
            self.commit_pending(ready, duration_ms)

    def commit_pending(self, ready: Ready, duration_ms: float = 0.0) -> None:
        """Write the checkpoint of every batch whose choice is stored and whose manifest is
        not (Spark committed them), oldest first; then forget the protocol's objects below
        the newest."""
        from dstl.spark.query import choose, forget_before, pending_choices

        latest = ready.coordinator.latest()
        newest = None
        for batch in pending_choices(ready.store, latest.checkpoint_id if latest else -1):
            choice = choose(ready.store, batch, self._partitions, delay_ms=self._time.delay_ms,
                            event_time=self._time.event_time_column is not None)
            assert choice is not None
            started, wall = time.monotonic(), time.time()
            reports = choice.decoded()
            cid = ready.coordinator.trigger([f"p{r.partition}" for r in reports],
                                            checkpoint_id=batch)
            props = {PROCESSING_TIME_PROPERTY: choice.processing_time_ms}
            if self._time.event_time_column is not None:
                props[WATERMARK_PROPERTY] = choice.watermark_ms
            ready.coordinator.set_properties(cid, props)
            completion = acknowledge(ready.coordinator, cid, reports)
            done = time.monotonic()
            times = BatchTimes(started - duration_ms / 1000.0, started, done, done)
            stats = batch_stats(batch, reports, completion, sum(r.rows_out for r in reports),
                                 times)
            stats.update(processing_time_ms=choice.processing_time_ms,
                         watermark_ms=-1, next_watermark_ms=choice.watermark_ms)
            self._recorder.record(ready.coordinator, stats, reports, wall)
            newest = batch
        if newest is not None:
            forget_before(ready.store, newest)
