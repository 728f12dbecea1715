"""``spark.readStream.format("dstl_changes")`` in every SparkSession, without
``dstl.spark.register(spark)``: PySpark's static registration of the change-feed source (one
``DefaultSource`` per ``pyspark_*`` module; how and why: :mod:`pyspark_dstl`)."""

from __future__ import annotations

from pyspark_dstl import DeferredSource

__all__ = ["DefaultSource"]


class DefaultSource(DeferredSource):
    """``spark.readStream.format("dstl_changes")``:
    :class:`dstl.spark.datasource.DstlChangesDataSource`."""

    target = "dstl.spark.datasource:DstlChangesDataSource"
    source_name = "dstl_changes"
