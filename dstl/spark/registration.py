"""``dstl.spark.register(spark)``: make ``spark.read.format("dstl")`` and
``spark.readStream.format("dstl_changes")`` known to a session (:mod:`dstl.spark.datasource`)."""

from __future__ import annotations

from typing import Any

__all__ = ["register"]


#: Spark refuses a Python data source that implements ``pushFilters`` unless this is on (it is
#: off by default in Spark 4.1-4.3); it only concerns Python data sources that push filters.
FILTER_PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"


def register(spark: Any) -> None:
    """Register the ``dstl`` (state, batch change feed) and ``dstl_changes`` (streaming change
    feed) data sources with ``spark`` (``spark.dataSource.register``; registering again replaces
    them), and turn on Python data source filter pushdown for the session (the sources push
    key, key-group, state and partition filters down to the key groups that can match)."""
    from dstl.spark.datasource import DstlChangesDataSource, DstlStateDataSource

    spark.conf.set(FILTER_PUSHDOWN_CONF, "true")
    spark.dataSource.register(DstlStateDataSource)
    spark.dataSource.register(DstlChangesDataSource)
