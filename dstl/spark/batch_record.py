"""What the operator keeps of each batch: its stats, its progress record, the metrics endpoint.

After each batch, a :class:`BatchRecorder` turns the partitions' reports and the phases' times
into one entry of ``batch_stats`` (:func:`batch_stats`) and one progress record shaped like
Spark's ``StreamingQueryProgress`` (:mod:`dstl.spark.progress`), both bounded to the last
``RECENT_PROGRESS`` batches, logs the record, calls the progress listeners and updates the
Prometheus endpoint (:mod:`dstl.spark.prometheus`; running totals, the last batch, the
coordinator's and the agents' metrics), which it starts when a port is set.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dstl.checkpoint import CheckpointCoordinator, Completion
from dstl.errors import ConfigError
from dstl.spark.progress import RECENT_PROGRESS, ProgressListener, ProgressTracker, progress_record
from dstl.spark.prometheus import MetricsSnapshot, PrometheusExporter
from dstl.spark.report import TaskReport
from dstl.spark.session_conf import METRICS_HOST_KEY, METRICS_PORT_KEY

__all__ = ["TOTALS", "BatchRecorder", "BatchTimes", "batch_stats", "latest_agent_metrics"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchTimes:
    """Monotonic times of one batch's phases."""

    started: float
    tasks_done: float  # the job finished: every task committed its partition
    acknowledged: float  # the manifest is written
    delivered: float  # the sink returned


def batch_stats(batch_id: int, reports: list[TaskReport], completion: Completion | None,
                 rows_out: int, t: BatchTimes) -> dict[str, Any]:
    """One entry of :attr:`DstlStatefulOperator.batch_stats
    <dstl.spark.operator.DstlStatefulOperator.batch_stats>`."""
    segments = sorted({k for r in reports for k in r.segment_keys})
    snapshots = sum(1 for r in reports if r.snapshot is not None)
    task_commit = max((r.commit_seconds for r in reports), default=0.0)
    return {
        "batch_id": batch_id, "batch_seconds": t.delivered - t.started,
        "job_seconds": t.tasks_done - t.started,
        "commit_seconds": t.acknowledged - t.tasks_done + task_commit,
        "manifest_seconds": t.acknowledged - t.tasks_done, "task_commit_seconds": task_commit,
        "sink_seconds": t.delivered - t.acknowledged,
        # rows received, as Spark's numInputRows: the late ones the tasks dropped included
        "rows_in": sum(r.rows_in + r.rows_late for r in reports), "rows_out": rows_out,
        "rows_late": sum(r.rows_late for r in reports),
        "segments": len(segments), "materializations": snapshots,
        "objects_written": len(segments) + snapshots + 1,
        "bytes_written": sum(r.log_bytes + r.snapshot_bytes for r in reports),
        "restores": sum(1 for r in reports if r.slot.access in ("restore", "rescale")),
        "restore_seconds": max((r.slot.restore_seconds for r in reports), default=0.0),
        "restore_seconds_total": sum(r.slot.restore_seconds for r in reports),
        "accesses": sorted(r.slot.access for r in reports),
        "deleted": len(completion.deleted) if completion is not None else 0,
        "agents": latest_agent_metrics(reports),
        "timers_fired": sum(r.timers_fired for r in reports),
        "ttl_purged": sum(r.ttl_purged for r in reports),
        # who served which partition: a partition that moved to another executor restores
        # through that executor's agent (agent_pid; 0: no agent)
        "tasks": [{"partition": r.partition, "attempt": r.attempt, "pid": r.pid,
                   "access": r.slot.access,
                   "agent_pid": int(r.agent_metrics["agent.pid"]) if r.agent_metrics else 0}
                  for r in sorted(reports, key=lambda r: r.partition)],
    }


def latest_agent_metrics(reports: list[TaskReport]) -> dict[int, dict[str, float]]:
    """Per agent pid, its newest metrics of the batch: several tasks of an executor report
    their agent's metrics, each taken after its own commit; the one that has served the most
    requests was taken last (so it counts every restore and upload of the batch)."""
    out: dict[int, dict[str, float]] = {}
    for r in reports:
        m = r.agent_metrics
        if not m:
            continue
        pid = int(m["agent.pid"])
        if pid not in out or m.get("agent.requests", 0.0) >= out[pid].get("agent.requests", 0.0):
            out[pid] = m
    return out


#: Prometheus running totals of the operator <- the batch_stats key they add up.
TOTALS = (("numRecordsIn", "rows_in"), ("numRecordsOut", "rows_out"),
           ("numberOfSegments", "segments"), ("numberOfUploadedObjects", "objects_written"),
           ("uploadedBytes", "bytes_written"), ("numberOfRestores", "restores"),
           ("numberOfMaterializations", "materializations"),
           ("numberOfDeletedObjects", "deleted"))


class BatchRecorder:
    """The recent batches of one operator (see the module docstring).

    Args:
        name: the operator's name.
        partitions: its partitions.
        table: its table kind (``"lmdb"`` or ``"heap"``).
    """

    def __init__(self, name: str, partitions: int, table: str) -> None:
        self._name = name
        self._partitions = partitions
        self._table = table
        #: per batch: rows, objects, bytes, accesses, seconds per phase, agents' metrics; the
        #: last RECENT_PROGRESS batches (older entries are dropped: the driver stays flat)
        self.batch_stats: list[dict[str, Any]] = []
        self.progress = ProgressTracker(RECENT_PROGRESS)
        #: the executor agents' latest log lines, as reported with the last batch
        self.agent_logs: list[str] = []
        self._totals: dict[str, float] = {}
        self._exporter: PrometheusExporter | None = None

    def add_listener(self, listener: ProgressListener) -> None:
        self.progress.add_listener(listener)

    def remove_listener(self, listener: ProgressListener) -> bool:
        return self.progress.remove_listener(listener)

    def start_exporter(self, port: int | None, conf: Mapping[str, str]) -> int | None:
        """Start the Prometheus endpoint if a port is set (``port``, else conf); returns the
        port it serves on (``None``: no endpoint).

        Raises:
            ConfigError: the conf's port is not a TCP port.
        """
        raw = conf.get(METRICS_PORT_KEY)
        if port is None and raw not in (None, "", "none", "None"):
            try:
                port = int(str(raw))
            except ValueError:
                port = -1
            if not 0 <= port <= 65535:
                raise ConfigError(METRICS_PORT_KEY, raw, "a TCP port 0 … 65535",
                                  owner="spark conf")
        if self._exporter is not None:
            return self._exporter.port
        if port is None:
            return None
        self._exporter = PrometheusExporter(self._name, port,
                                            conf.get(METRICS_HOST_KEY, "0.0.0.0"))
        logger.info("operator %s serves Prometheus metrics on port %d", self._name,
                    self._exporter.port)
        return self._exporter.port

    def close(self) -> None:
        """Stop the metrics endpoint."""
        exporter, self._exporter = self._exporter, None
        if exporter is not None:
            exporter.close()

    def record(self, coordinator: CheckpointCoordinator, stats: dict[str, Any],
               reports: list[TaskReport], wall_start: float) -> None:
        """Keep the batch's stats and progress record (bounded), log it, tell the listeners
        and the metrics endpoint."""
        self.batch_stats.append(stats)
        del self.batch_stats[:-RECENT_PROGRESS]
        self.agent_logs = [line for r in reports for line in r.agent_log][-10:]
        progress = progress_record(self._name, self._partitions, self._table, stats, reports,
                                   wall_start)
        logger.info("operator %s progress %s", self._name,
                    json.dumps(progress, separators=(",", ":")))
        self.progress.record(progress)
        if self._exporter is not None:
            self._exporter.update(self._metrics_snapshot(coordinator, stats, progress))

    def _metrics_snapshot(self, coordinator: CheckpointCoordinator, stats: dict[str, Any],
                          progress: dict[str, Any]) -> MetricsSnapshot:
        """The Prometheus endpoint's view after this batch (running totals, the last batch,
        the coordinator's and the agents' metrics)."""
        t = self._totals
        for name, key in TOTALS:
            t[name] = t.get(name, 0.0) + float(stats[key])
        t["numberOfCompletedBatches"] = t.get("numberOfCompletedBatches", 0.0) + 1
        state = progress["stateOperators"][0]
        last = {"lastBatchId": float(stats["batch_id"]),
                "lastBatchDurationMs": stats["batch_seconds"] * 1000,
                "lastBatchTasksMs": stats["job_seconds"] * 1000,
                "lastBatchManifestMs": stats["manifest_seconds"] * 1000,
                "lastBatchRestoreMs": stats["restore_seconds"] * 1000,
                "numRowsTotal": float(state["numRowsTotal"]),
                "stateDiskBytes": float(state["diskBytes"]),
                "stateMemoryBytes": float(state["memoryUsedBytes"])}
        return MetricsSnapshot(self._name, dict(t), last, coordinator.stats(),
                               dict(stats["agents"]))
