"""Batches without input: ``with_heartbeat`` unions a low-rate rate source into a stream.

Spark runs a ``foreachBatch`` micro-batch only when a source has new data, so a quiet stream
would never fire its timers (sessions never close, windows never emit). The heartbeat is a
``rate`` source of ``rows_per_second`` rows whose columns are the stream's, all null, plus a
marker column (:data:`~dstl.spark.timing.HEARTBEAT_COLUMN`, true). With a processing-time
trigger (``.trigger(processingTime="10 seconds")``) every trigger then has new data, so a batch
runs every interval; :class:`~dstl.spark.DstlStatefulOperator` drops the heartbeat rows before
routing, so processors never see them, they carry no event time (the watermark ignores them),
and every partition's task still runs and fires its due timers.

Cost (measured, docs/spark.md): one micro-batch per trigger interval while the stream is idle
— Spark's own per-batch work, one job of ``partitions`` tasks, and the checkpoint (a manifest,
plus segments only for partitions whose state changed: firing a timer changes state).
"""

from __future__ import annotations

from typing import Any

from dstl.checks import check_int
from dstl.spark.timing import HEARTBEAT_COLUMN

__all__ = ["with_heartbeat"]

#: More heartbeat rows than this per second would be a data source, not a heartbeat.
MAX_HEARTBEAT_ROWS_PER_SECOND = 1000


def with_heartbeat(stream_df: Any, rows_per_second: int = 1) -> Any:
    """``stream_df`` with a heartbeat: use it as the operator's input, with a processing-time
    trigger, so batches (and the timers they fire) run while no data arrives.

    Args:
        stream_df: a streaming DataFrame (the operator's input).
        rows_per_second: the heartbeat's rate (1 is enough for any trigger of 1 s or more).

    Raises:
        ConfigError: ``rows_per_second`` out of range, or the stream already has the marker
            column.
    """
    from pyspark.sql import functions as F

    from dstl.errors import ConfigError

    check_int(rows_per_second, "rows_per_second", "with_heartbeat", lo=1,
              hi=MAX_HEARTBEAT_ROWS_PER_SECOND, fix="1 row per second is enough")
    if HEARTBEAT_COLUMN in stream_df.columns:
        raise ConfigError("stream_df", HEARTBEAT_COLUMN, "a stream without a heartbeat",
                          owner="with_heartbeat", fix="call with_heartbeat once")
    beat = (stream_df.sparkSession.readStream.format("rate")
            .option("rowsPerSecond", rows_per_second).load()
            .select(*[F.lit(None).cast(f.dataType).alias(f.name)
                      for f in stream_df.schema.fields],
                    F.lit(True).alias(HEARTBEAT_COLUMN)))
    return (stream_df.withColumn(HEARTBEAT_COLUMN, F.lit(None).cast("boolean"))
            .unionByName(beat))
