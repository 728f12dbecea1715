"""A batch's base and times: the checkpoint it starts from, its processing time, its watermark.

Theory of operation
-------------------
:class:`BatchTime` decides, on the driver, what every task of a batch gets besides its rows
(:class:`~dstl.spark.config.TaskInput`), and what the batch's checkpoint records:

1. **Base.** The newest retained checkpoint below the batch id, so a re-run of a batch starts
   from the same state as its first run; a batch below every retained checkpoint belongs to
   another query (an error).
2. **Processing time** (the TTL clock, processing-time timers): a re-run of a committed batch
   keeps the time its checkpoint recorded; otherwise the driver's clock, never below the base's.
3. **Watermark.** The one the base committed (0 before any; -1 without an event-time column);
   after the batch, :func:`~dstl.spark.timing.next_watermark` of the largest event time the
   tasks saw, written into the checkpoint with the processing time (:meth:`commit_properties`).
4. **Late rows.** With a watermark, the input gets the event-time column (epoch ms) the tasks
   drop late rows by; with ``late_rows="side_output"`` the late rows are also split off for the
   late sink (:meth:`split_late`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from dstl.checkpoint import CheckpointCoordinator
from dstl.checkpoint.manifest import Manifest
from dstl.errors import CorruptObjectError, UsageError
from dstl.spark.config import TaskInput
from dstl.spark.operator_checks import TimeSettings
from dstl.spark.query import PROCESSING_TIME_PROPERTY, WATERMARK_PROPERTY, state_of_another_query
from dstl.spark.report import TaskReport
from dstl.spark.timing import EVENT_TIME_COLUMN, next_watermark

__all__ = ["INT_TYPES", "BatchTime", "driver_version", "event_time_ms", "time_property"]

#: Spark's integer column types (an event-time column may be epoch ms in one of them).
INT_TYPES = ("int", "bigint", "smallint", "tinyint")


def driver_version() -> str:
    """The DSTL version the driver runs (every task checks its own against it)."""
    import dstl

    return dstl.__version__


def event_time_ms(df: Any, column: str) -> Any:
    """The event time of ``column`` as epoch ms (a long column expression).

    Raises:
        UsageError: the column is missing or not a timestamp or integer column.
    """
    from pyspark.sql import functions as F

    kind = dict(df.dtypes).get(column)
    quoted = f"`{column}`"
    if kind in ("timestamp", "timestamp_ntz"):
        return F.expr(f"cast(floor(unix_micros(cast({quoted} as timestamp)) / 1000) as bigint)")
    if kind in INT_TYPES:
        return F.expr(f"cast({quoted} as bigint)")
    raise UsageError(f"event_time_column {column!r} is "
                     f"{'missing' if kind is None else 'of type ' + kind}; DSTL takes a "
                     "timestamp column or an integer column of epoch milliseconds")


def time_property(manifest: Manifest | None) -> int | None:
    """The processing time a manifest recorded (``None``: no manifest, or one written before
    the property existed).

    Raises:
        CorruptObjectError: the property is not a non-negative integer.
    """
    if manifest is None or PROCESSING_TIME_PROPERTY not in manifest.properties:
        return None
    t = manifest.properties[PROCESSING_TIME_PROPERTY]
    if isinstance(t, bool) or not isinstance(t, int) or t < -1:
        raise CorruptObjectError(manifest.key, 0, f"properties.{PROCESSING_TIME_PROPERTY} is "
                                                  f"{t!r}, not an integer of epoch ms")
    return t if t >= 0 else None


class BatchTime:
    """A batch's base and times (see the module docstring).

    Args:
        time: the operator's time settings.
        state_uri: the operator's store (named in the error of a batch of another query).
        clock_ms: the processing-time clock, epoch ms.
    """

    def __init__(self, time: TimeSettings, state_uri: str, clock_ms: Callable[[], int]) -> None:
        self._time = time
        self._state_uri = state_uri
        self._clock_ms = clock_ms

    def split_late(self, df: Any, watermark_ms: int) -> tuple[Any, Any]:
        """With a watermark: ``df`` with the event-time column (epoch ms) the tasks take the
        maximum of and drop the late rows by (:func:`dstl.spark.task.drop_late`: so the
        batch's ``numInputRows`` counts every row received, as Spark's does); and the late rows
        (user columns) for the side output (``None``: dropped, or no watermark)."""
        event_col = self._time.event_time_column
        if event_col is None:
            return df, None
        from pyspark.sql import functions as F

        with_ms = df.withColumn(EVENT_TIME_COLUMN, event_time_ms(df, event_col))
        if self._time.late_rows != "side_output":
            return with_ms, None
        late = F.col(EVENT_TIME_COLUMN) <= F.lit(watermark_ms)
        return with_ms, with_ms.where(late).drop(EVENT_TIME_COLUMN)

    def commit_properties(self, coordinator: CheckpointCoordinator, checkpoint_id: int,
                           task_input: TaskInput, reports: list[TaskReport]) -> int:
        """Put the batch's processing time and the watermark after it into the checkpoint's
        manifest; returns the watermark (-1: none)."""
        props: dict[str, int] = {PROCESSING_TIME_PROPERTY: task_input.processing_time_ms}
        wm = -1
        if self._time.event_time_column is not None:
            seen = [r.max_event_time_ms for r in reports if r.max_event_time_ms is not None]
            wm = next_watermark(task_input.watermark_ms, max(seen) if seen else None,
                                self._time.delay_ms)
            props[WATERMARK_PROPERTY] = wm
        coordinator.set_properties(checkpoint_id, props)
        return wm

    def task_input(self, coordinator: CheckpointCoordinator, batch_id: int) -> TaskInput:
        """The batch's base: the newest retained checkpoint below ``batch_id``, so a re-run of a
        batch starts from the same state as its first run.

        Raises:
            UsageError: every retained checkpoint is at or after ``batch_id`` (the state belongs
                to another query).
        """
        retained = coordinator.manifests()
        base = max((m for m in retained if m.checkpoint_id < batch_id),
                   key=lambda m: m.checkpoint_id, default=None)
        if base is None and any(m.checkpoint_id >= batch_id for m in retained):
            raise state_of_another_query(batch_id, self._state_uri,
                                         (m.checkpoint_id for m in retained))
        return TaskInput(batch_id=batch_id,
                         base_checkpoint=base.checkpoint_id if base is not None else -1,
                         base_handles={int(t.task_id[1:]): json.dumps(t.state)
                                       for t in base.tasks} if base is not None else {},
                         retained=tuple(sorted(m.checkpoint_id for m in retained)),
                         processing_time_ms=self._processing_time(retained, batch_id, base),
                         watermark_ms=self._base_watermark(base),
                         driver_version=driver_version())

    def _processing_time(self, retained: Sequence[Manifest], batch_id: int,
                         base: Manifest | None) -> int:
        """The batch's processing time (the TTL clock and processing-time timers' time): a
        re-run of a batch whose checkpoint was committed keeps the time that checkpoint
        recorded, so it expires and fires exactly what the first run did; otherwise the
        driver's clock, never below the base checkpoint's time (a clock that steps back does
        not make expired state visible again, nor fire timers twice)."""
        rerun = next((m for m in retained if m.checkpoint_id == batch_id), None)
        recorded = time_property(rerun)
        if recorded is not None:
            return recorded
        now = int(self._clock_ms())
        before = time_property(base)
        return now if before is None else max(now, before)

    def _base_watermark(self, base: Manifest | None) -> int:
        """The batch's watermark: the one its base checkpoint committed (0 before any; -1: no
        watermark configured).

        Raises:
            CorruptObjectError: the base manifest's watermark is not an integer.
        """
        if self._time.event_time_column is None:
            return -1
        wm = base.properties.get(WATERMARK_PROPERTY, 0) if base is not None else 0
        if isinstance(wm, bool) or not isinstance(wm, int):
            assert base is not None
            raise CorruptObjectError(base.key, 0, f"properties.{WATERMARK_PROPERTY} is "
                                                  f"{wm!r}, not an integer")
        return wm
