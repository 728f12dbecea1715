"""DSTL under PySpark: a keyed stateful operator for ``writeStream.foreachBatch``.

Usage (see docs/spark.md)::

    from dstl.spark import StatefulProcessor, DstlStatefulOperator

    class Count(StatefulProcessor):
        def init(self, handle): self.count = handle.get_value_state("count")
        def handle_input_rows(self, key, rows):
            c = (self.count.get() or 0) + sum(1 for _ in rows)
            self.count.update(c)
            yield {"key": key, "count": c}

    op = DstlStatefulOperator(name="count", processor=Count, key_column="key",
                              output_schema="key string, count long", state_uri="s3://b/app",
                              partitions=4, max_parallelism=128, table="lmdb",
                              sink=lambda out_df, batch_id: ...)
    stream_df.writeStream.foreachBatch(op.foreach_batch).option("checkpointLocation", ck).start()

Reading the state back (docs/spark.md, "Reading state")::

    dstl.spark.register(spark)        # the operator does it too when it starts
    spark.read.format("dstl").option("operator", "count").load("s3://b/app")
    spark.readStream.format("dstl_changes").option("operator", "count").load("s3://b/app")
"""

from dstl.spark.heartbeat import with_heartbeat
from dstl.spark.operator import DstlStatefulOperator
from dstl.spark.processor import StatefulProcessor, StatefulProcessorHandle, ValueStateView
from dstl.spark.registration import register
from dstl.spark.timing import ExpiredTimerInfo, TimerValues

__all__ = ["DstlStatefulOperator", "ExpiredTimerInfo", "StatefulProcessor",
           "StatefulProcessorHandle", "TimerValues", "ValueStateView", "register",
           "with_heartbeat"]
