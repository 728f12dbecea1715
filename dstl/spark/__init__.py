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

    spark.read.format("dstl").option("operator", "count").load("s3://b/app")
    spark.readStream.format("dstl_changes").option("operator", "count").load("s3://b/app")

Import cost: the driver-side names (``DstlStatefulOperator``, ``register``, ``with_heartbeat``)
are imported on first use (PEP 562), not with the package. Every Python worker imports this
package to run a task and the executor agent to start; neither needs the driver's coordinator,
manifests or metrics endpoint, and the first batch after a restart waits for both imports
(``bench/restart.py``: worker start-up is most of that batch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dstl.spark.processor import StatefulProcessor, StatefulProcessorHandle, ValueStateView
from dstl.spark.timing import ExpiredTimerInfo, TimerValues

if TYPE_CHECKING:
    from dstl.spark.heartbeat import with_heartbeat
    from dstl.spark.operator import DstlStatefulOperator
    from dstl.spark.registration import register

#: name -> the module that defines it, imported on first access
_LAZY = {"DstlStatefulOperator": "dstl.spark.operator", "register": "dstl.spark.registration",
         "with_heartbeat": "dstl.spark.heartbeat"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'dstl.spark' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


__all__ = ["DstlStatefulOperator", "ExpiredTimerInfo", "StatefulProcessor",
           "StatefulProcessorHandle", "TimerValues", "ValueStateView", "register",
           "with_heartbeat"]
