"""Per-batch progress of the Spark operator, shaped like Spark's ``StreamingQueryProgress``.

Theory of operation
-------------------
After each micro-batch the driver turns the batch's phase times and the partitions' task reports
(:class:`~dstl.spark.report.TaskReport`) into one plain dict (:func:`progress_record`): the
fields a Spark user already reads from ``query.lastProgress`` (``batchId``, ``timestamp``,
``numInputRows``, ``durationMs`` by phase, one ``stateOperators`` entry with ``numRowsTotal``,
``numRowsUpdated``, ``memoryUsedBytes`` and ``customMetrics``) plus DSTL's own figures
(segments, objects uploaded, restores, materializations, bytes). It is JSON-serialisable, so the
driver logs it as one line.

:class:`ProgressTracker` keeps the last ``retained`` records (Spark keeps the last
``spark.sql.streaming.numRecentProgressUpdates`` = 100) and calls the registered listeners with
each new one. Listeners are the user's code: one that raises is logged with its traceback and
the others still run; the batch (already committed when listeners run) never fails because of
one. The tracker is bounded, so a query that runs for months keeps a flat driver.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from dstl.errors import ConfigTypeError

__all__ = ["RECENT_PROGRESS", "ProgressListener", "ProgressTracker", "progress_record"]

logger = logging.getLogger(__name__)

#: Records kept (Spark's default of ``spark.sql.streaming.numRecentProgressUpdates``).
RECENT_PROGRESS = 100

ProgressListener = Callable[[dict[str, Any]], object]


def progress_record(operator: str, partitions: int, table: str, stats: Mapping[str, Any],
                    reports: list[Any], wall_start: float) -> dict[str, Any]:
    """One batch's progress record (see the module docstring).

    Args:
        operator: the operator's name; partitions, table: its settings.
        stats: the batch's entry of ``DstlStatefulOperator.batch_stats``.
        reports: the batch's task reports.
        wall_start: the batch's start as a Unix time (the ``timestamp``).
    """
    seconds = float(stats["batch_seconds"])
    rows_in = int(stats["rows_in"])

    def ms(key: str) -> int:
        return round(float(stats[key]) * 1000)

    return {
        "id": operator, "name": operator, "batchId": int(stats["batch_id"]),
        "timestamp": datetime.fromtimestamp(wall_start, UTC).isoformat(
            timespec="milliseconds").replace("+00:00", "Z"),
        "numInputRows": rows_in, "numOutputRows": int(stats["rows_out"]),
        "processedRowsPerSecond": rows_in / seconds if seconds > 0 else 0.0,
        "durationMs": {"triggerExecution": ms("batch_seconds"), "tasks": ms("job_seconds"),
                       "taskCommit": ms("task_commit_seconds"),
                       "manifest": ms("manifest_seconds"), "sink": ms("sink_seconds"),
                       "restore": ms("restore_seconds")},
        "stateOperators": [{
            "operatorName": f"dstl:{operator}", "storeProvider": f"dstl-{table}",
            # the user's state rows, as Spark's numRowsTotal (DSTL's own: internalRows)
            "numRowsTotal": sum(r.state_rows for r in reports),
            "numRowsUpdated": sum(r.keys for r in reports),
            # LMDB: the environments' pages in use; heap: a sampled estimate (task reports)
            "memoryUsedBytes": sum(r.state_memory_bytes for r in reports),
            "diskBytes": sum(r.state_disk_bytes for r in reports),
            "numShufflePartitions": partitions, "numStateStoreInstances": partitions,
            "customMetrics": {
                "segments": int(stats["segments"]), "objectsWritten": int(stats["objects_written"]),
                "bytesWritten": int(stats["bytes_written"]), "restores": int(stats["restores"]),
                "restoreMs": ms("restore_seconds_total"),
                "materializations": int(stats["materializations"]),
                "deletedObjects": int(stats["deleted"]),
                "agents": len(stats["agents"]),
                "timersFired": int(stats.get("timers_fired", 0)),
                "ttlPurged": int(stats.get("ttl_purged", 0)),
                "lateRows": int(stats.get("rows_late", 0)),
                "internalRows": sum(r.internal_rows for r in reports),
                "tableRecords": sum(r.state_entries for r in reports),
            },
        }],
        **_event_time(stats),
    }


def _event_time(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Spark's ``eventTime.watermark`` (ISO 8601) when the operator keeps a watermark."""
    wm = int(stats.get("watermark_ms", -1))
    if wm < 0:
        return {}
    return {"eventTime": {"watermark": datetime.fromtimestamp(wm / 1000, UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")}}


class ProgressTracker:
    """The last ``retained`` progress records and the listeners (thread-safe)."""

    def __init__(self, retained: int = RECENT_PROGRESS) -> None:
        self._records: deque[dict[str, Any]] = deque(maxlen=retained)
        self._listeners: list[ProgressListener] = []
        self._lock = threading.Lock()

    @property
    def last(self) -> dict[str, Any] | None:
        with self._lock:
            return self._records[-1] if self._records else None

    @property
    def recent(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._records)

    def add_listener(self, listener: ProgressListener) -> None:
        """Call ``listener(progress)`` after every batch from now on.

        Raises:
            ConfigTypeError: not callable.
        """
        if not callable(listener):
            raise ConfigTypeError("listener", listener, "a callable taking the progress dict",
                                  owner="DstlStatefulOperator.add_listener")
        with self._lock:
            self._listeners.append(listener)

    def remove_listener(self, listener: ProgressListener) -> bool:
        """Stop calling ``listener``; whether it was registered."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)
                return True
            return False

    def record(self, progress: dict[str, Any]) -> None:
        """Keep ``progress`` and hand it to every listener (a listener's exception is logged)."""
        with self._lock:
            self._records.append(progress)
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(progress)
            except Exception:
                # the batch is committed; a monitoring hook must not fail the query
                logger.exception("progress listener %r failed on batch %s (ignored)", listener,
                                 progress.get("batchId"))
