"""What a partition task returns to the driver: :class:`TaskReport`.

Theory of operation
-------------------
Each ``mapInArrow`` task yields its output rows and then exactly one more row whose
:data:`REPORT_COLUMN` holds its report as JSON (every other column null; output rows have a null
report). The driver splits the two, acknowledges each partition's backend handle to the
checkpoint coordinator and sums the figures into the batch's stats.

The report crosses a process boundary (executor -> JVM -> driver), so the driver decodes it
with :meth:`TaskReport.from_json`, which checks every field and raises :class:`TaskReportError`
naming the field; the backend handle inside is validated like any handle read from a store.
Driver and executors run the same DSTL version, so a malformed report is a bug, not a case to
tolerate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, cast, get_args

from dstl.errors import DstlError, UsageError
from dstl.spark.fields import Fields
from materializer.handles import ChangelogStateBackendHandle, SnapshotRef
from materializer.timers import MIN_TIMESTAMP_MS

__all__ = ["INITIAL_STATE_COLUMN", "REPORT_COLUMN", "Access", "SlotAccess", "TaskReport", "TaskReportError"]

#: The column of a task's report row (null in output rows).
REPORT_COLUMN = "_dstl_report"
#: The column carrying an ``initial_state`` row (a struct) to its key's task, in a query's
#: first batch; null on input rows.
INITIAL_STATE_COLUMN = "_dstl_init"

#: How a task got its partition's state at the base checkpoint (see :mod:`dstl.spark.slots`):
#: its own backend (``hit``), another worker's table on this executor (``adopt``), the store
#: (``restore``; ``rescale`` when the partitioning changed), or none yet (``new``).
Access = Literal["hit", "adopt", "restore", "rescale", "new"]
_ACCESSES: tuple[str, ...] = get_args(Access)


class TaskReportError(UsageError):
    """A task report the driver cannot read (the driver and its executors run different DSTL
    versions, or a bug)."""

    def __init__(self, where: str, detail: str) -> None:
        self.where = where
        self.detail = detail
        super().__init__(f"malformed {where}: {detail}; the driver and the executors must run "
                         "the same DSTL version")


@dataclass(frozen=True, slots=True)
class SlotAccess:
    """How a task got its partition's state, and what a restore cost."""

    access: Access
    restore_seconds: float = 0.0
    restored_changes: int = 0
    restored_entries: int = 0


@dataclass(frozen=True, slots=True)
class TaskReport:
    """One partition task's result for the driver.

    Attributes:
        partition, attempt, pid: which task, which attempt of it, which worker process.
        handle: the partition's backend handle for this batch's checkpoint.
        slot: how the task got the base state (:class:`SlotAccess`).
        rows_in, rows_out, keys: rows read, rows yielded, distinct keys.
        process_seconds: from the task's start to the processor's last row (state access
            included).
        commit_seconds: from there to the checkpoint being durable and committed.
        segment_keys: the segments this task's change sets went to (shared with other tasks of
            the executor under the agent).
        log_bytes: stored bytes of this task's change sets.
        snapshot: the snapshot this checkpoint took or installed (``None``: none).
        agent_metrics: the executor agent's metrics after the commit (``None``: no agent).
        agent_log: the agent's last log lines.
        max_event_time_ms: the largest event time (epoch ms) among the task's input rows
            (``None``: no watermark, or no row with an event time); the driver's watermark.
        timers_fired: expired timers the task delivered to the processor.
        ttl_purged: values of TTL states (list elements, map entries) the task purged.
        state_entries, state_disk_bytes, state_memory_bytes: the partition's table after the
            commit (records; the LMDB environment's pages in use, heap: 0 bytes; memory: LMDB's
            pages in use, the heap's sampled estimate), from figures whose cost does not grow
            with the state.
        rows_late: rows the task dropped as late (at or below the watermark), counted in the
            first partition of a task; ``rows_in`` are the others.
        state_rows, internal_rows: the records of the user's states in the table, and of
            DSTL's own (timers, TTL indexes); ``state_entries`` also counts LMDB's few layout
            records.
    """

    partition: int
    attempt: int
    pid: int
    handle: ChangelogStateBackendHandle
    slot: SlotAccess
    rows_in: int
    rows_out: int
    keys: int
    process_seconds: float
    commit_seconds: float
    segment_keys: tuple[str, ...]
    log_bytes: int
    snapshot: SnapshotRef | None
    agent_metrics: dict[str, float] | None
    agent_log: tuple[str, ...]
    max_event_time_ms: int | None = None
    timers_fired: int = 0
    state_entries: int = 0
    state_disk_bytes: int = 0
    ttl_purged: int = 0
    state_memory_bytes: int = 0
    state_rows: int = 0
    internal_rows: int = 0
    rows_late: int = 0

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of the snapshot this checkpoint added (0: none)."""
        return self.snapshot.size if self.snapshot is not None else 0

    def to_json(self) -> str:
        s = self.slot
        return json.dumps({
            "partition": self.partition, "attempt": self.attempt, "pid": self.pid,
            "handle": self.handle.to_json_obj(), "access": s.access,
            "restore_seconds": s.restore_seconds, "restored_changes": s.restored_changes,
            "restored_entries": s.restored_entries, "rows_in": self.rows_in,
            "rows_out": self.rows_out, "keys": self.keys,
            "process_seconds": self.process_seconds, "commit_seconds": self.commit_seconds,
            "segment_keys": list(self.segment_keys), "log_bytes": self.log_bytes,
            "snapshot": None if self.snapshot is None else self.snapshot.to_json_obj(),
            "agent_metrics": self.agent_metrics, "agent_log": list(self.agent_log),
            "max_event_time_ms": self.max_event_time_ms, "timers_fired": self.timers_fired,
            "state_entries": self.state_entries, "state_disk_bytes": self.state_disk_bytes,
            "ttl_purged": self.ttl_purged,
            "state_memory_bytes": self.state_memory_bytes, "state_rows": self.state_rows,
            "internal_rows": self.internal_rows, "rows_late": self.rows_late,
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TaskReport:
        """Decode and validate a report (untrusted: it crossed two process boundaries).

        Raises:
            TaskReportError: malformed JSON or a malformed field.
        """
        obj = _json_object(text)
        partition = Fields(obj, "task report", TaskReportError).integer("partition")
        f = Fields(obj, f"task report of partition {partition}", TaskReportError)
        return cls(partition, f.integer("attempt"), f.integer("pid"), _handle(f),
                   _slot_access(f), f.integer("rows_in"), f.integer("rows_out"),
                   f.integer("keys"), f.number("process_seconds"), f.number("commit_seconds"),
                   f.texts("segment_keys"), f.integer("log_bytes"), _snapshot(f),
                   None if f.get("agent_metrics") is None else f.numbers("agent_metrics"),
                   f.texts("agent_log"), f.opt_integer("max_event_time_ms", MIN_TIMESTAMP_MS),
                   f.integer("timers_fired"), f.integer("state_entries"),
                   f.integer("state_disk_bytes"), f.integer("ttl_purged"),
                   f.integer("state_memory_bytes"), f.integer("state_rows"),
                   f.integer("internal_rows"), f.integer("rows_late"))


def _json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except (TypeError, ValueError) as exc:
        raise TaskReportError("task report", f"not JSON ({exc})") from exc
    if not isinstance(obj, dict):
        raise TaskReportError("task report", f"a JSON {type(obj).__name__}, not an object")
    return obj


def _handle(f: Fields) -> ChangelogStateBackendHandle:
    raw = f.mapping("handle")
    try:
        return ChangelogStateBackendHandle.from_json_obj(raw)
    except DstlError as exc:
        raise f.bad("handle", f"a backend handle ({exc})") from exc


def _slot_access(f: Fields) -> SlotAccess:
    access = f.text("access")
    if access not in _ACCESSES:
        raise f.bad("access", f"one of {', '.join(_ACCESSES)}")
    return SlotAccess(cast(Access, access), f.number("restore_seconds"),
                      f.integer("restored_changes"), f.integer("restored_entries"))


def _snapshot(f: Fields) -> SnapshotRef | None:
    raw = f.opt_mapping("snapshot")
    if raw is None:
        return None
    try:
        return SnapshotRef.from_json_obj(raw)
    except DstlError as exc:
        raise f.bad("snapshot", f"a snapshot reference or null ({exc})") from exc
