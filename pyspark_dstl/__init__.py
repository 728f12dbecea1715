"""``spark.read.format("dstl")`` in every SparkSession, without ``dstl.spark.register(spark)``.

Theory of operation
-------------------
PySpark registers Python data sources by itself: the first time a session resolves a data
source name, the JVM starts one Python worker (``pyspark/sql/worker/lookup_data_sources.py``)
that walks ``pkgutil.iter_modules()``, imports every top-level module whose name starts with
``pyspark_`` and registers its ``DefaultSource`` class (a ``DataSource``) under
``DefaultSource.name()``. The JVM does this once per process and keeps the result for every
session it starts. One module gives one source, so the change-feed stream has its own
package, :mod:`pyspark_dstl_changes`.

That lookup imports this package in *every* Spark application of a Python where DSTL is
installed, DSTL's reads or not, and an import error there would make Spark skip every
statically registered source of the application. So this package imports nothing of DSTL:
:class:`DeferredSource` names the real source (:mod:`dstl.spark.datasource`) and imports it
when Spark first asks the source for something — its schema or a reader, in the workers that
plan a read, which import it anyway. Importing this package costs pyspark's ``DataSource``
(already imported by the lookup) and nothing else.

``dstl.spark.register(spark)`` still registers the sources themselves; Spark then uses the
session's registration instead of this one.
"""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from pyspark.sql.datasource import DataSource

__all__ = ["DefaultSource", "DeferredSource"]


class DeferredSource(DataSource):
    """A data source that hands every call to the class :attr:`target` names, imported on the
    first call (``"module:Class"``, a :class:`~pyspark.sql.datasource.DataSource`)."""

    #: the source Spark's calls go to
    target: ClassVar[str]
    #: the format name, ``target``'s own ``name()`` (tests check that they agree)
    source_name: ClassVar[str]

    @classmethod
    def name(cls) -> str:
        return cls.source_name

    def _source(self) -> Any:
        module, _, qualname = self.target.partition(":")
        cls = getattr(importlib.import_module(module), qualname)
        return cls(self.options)

    def schema(self) -> Any:
        return self._source().schema()

    def reader(self, schema: Any) -> Any:
        return self._source().reader(schema)

    def streamReader(self, schema: Any) -> Any:
        return self._source().streamReader(schema)


class DefaultSource(DeferredSource):
    """``spark.read.format("dstl")``: :class:`dstl.spark.datasource.DstlStateDataSource`."""

    target = "dstl.spark.datasource:DstlStateDataSource"
    source_name = "dstl"
