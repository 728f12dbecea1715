"""``dstl.spark.register(spark)``: register ``spark.read.format("dstl")`` and
``spark.readStream.format("dstl_changes")`` (:mod:`dstl.spark.datasource`) in one session and
turn Spark's filter pushdown on there.

Every session knows both sources without it: PySpark registers them itself from the installed
packages :mod:`pyspark_dstl` and :mod:`pyspark_dstl_changes`. A session's own registration
takes precedence over that one (Spark logs a warning that it replaced it), so calling this is
harmless; what it adds is the pushdown conf.
"""

from __future__ import annotations

from typing import Any

__all__ = ["enable_filter_pushdown", "register"]


#: Spark pushes filters to a Python data source only with this on (off by default in Spark
#: 4.1-4.3), and refuses a reader implementing ``pushFilters`` while it is off; the sources
#: leave ``pushFilters`` out then (:func:`dstl.spark.datasource._batch_reader`). It only
#: concerns Python data sources that push filters.
FILTER_PUSHDOWN_CONF = "spark.sql.python.filterPushdown.enabled"


def enable_filter_pushdown(spark: Any) -> None:
    """Turn on Python data source filter pushdown for ``spark``'s session (a runtime conf: the
    sources PySpark registered from :mod:`pyspark_dstl` push filters with it). What the operator
    does when it starts: registering the sources again would cost a fresh session seconds
    (PySpark pickles each source and checks it in a Python worker) for nothing."""
    spark.conf.set(FILTER_PUSHDOWN_CONF, "true")


def register(spark: Any) -> None:
    """Register the ``dstl`` (state, batch change feed) and ``dstl_changes`` (streaming change
    feed) data sources with ``spark`` (``spark.dataSource.register``; registering again replaces
    them, as it replaces the ones PySpark registered from :mod:`pyspark_dstl`), and turn on
    Python data source filter pushdown for the session (the sources push key, key-group, state
    and partition filters down to the key groups that can match)."""
    from dstl.spark.datasource import DstlChangesDataSource, DstlStateDataSource

    enable_filter_pushdown(spark)
    spark.dataSource.register(DstlStateDataSource)
    spark.dataSource.register(DstlChangesDataSource)
