"""The operator inside the user's query: what :meth:`DstlStatefulOperator.transform
<dstl.spark.operator.DstlStatefulOperator.transform>` adds to the plan.

The rows are routed to partitions by key group in the JVM (:func:`routing_sql`, the same
expression the ``foreach_batch`` job and the warm-up use), the state tasks run in ``mapInArrow``
under the name :func:`plan_name` gives them, and their metrics rows feed the query's observed
metrics (:func:`with_observed_metrics`). An ``initial_state`` is staged in the store before the
query starts (:func:`stage_initial_state`); late rows may ride along in a struct column
(:func:`late_rows_field`).
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from dstl.errors import UsageError
from dstl.spark.batch_commit import Ready
from dstl.spark.report import INITIAL_STATE_COLUMN

__all__ = ["check_transform", "key_routing_sql", "late_rows_field", "plan_name", "routing_sql",
           "stage_initial_state", "with_observed_metrics"]

logger = logging.getLogger(__name__)


def check_transform(df: Any, name: str, has_sink: bool, has_late_sink: bool,
                    late_column: str) -> None:
    """Refuse what ``DstlStatefulOperator.transform`` cannot do (see its ``Raises``)."""
    if not getattr(df, "isStreaming", False):
        raise UsageError(f"operator {name!r}: transform takes a streaming DataFrame "
                         "(spark.readStream...); for a batch DataFrame call "
                         "op.foreach_batch(df, batch_id)")
    for given, what, instead in (
            (has_sink, "a sink", "the output DataFrame is the sink's input"),
            (has_late_sink, "a late_sink",
             f"late rows are rows of the output DataFrame, in its "
             f"{late_column!r} column")):
        if given:
            raise UsageError(f"operator {name!r} has {what}, which only "
                             f"foreach_batch supports; inside the query {instead} (drop "
                             "the argument)")


def late_rows_field(df: Any, out_schema: Any, late_column: str) -> tuple[Any, Any]:
    """The late rows' column ``late_column`` (``late_rows="side_output"``): a struct of
    ``df``'s columns, as the Arrow field the state tasks write and the output schema with it
    appended."""
    import pyarrow as pa
    from pyspark.sql.pandas.types import to_arrow_type
    from pyspark.sql.types import StructField, StructType

    struct = StructType(list(df.schema.fields))
    late = StructField(late_column, struct, True)
    arrow = pa.field(late.name, to_arrow_type(struct, timezone="UTC"), True)
    return arrow, StructType([*out_schema.fields, late])


def stage_initial_state(ready: Ready, df: Any, initial_state: Any, key_column: str,
                        partitions: int, max_parallelism: int, name: str) -> None:
    """Stage ``initial_state`` in the store for the query's first batch
    (:mod:`dstl.spark.initial`) unless the state exists (a checkpoint, or results of a
    batch: the initial state was applied) or a staging finished before (a driver that
    stopped before the first batch committed): one batch job, rows routed by key group in
    the JVM as the input is, written by the executors; then the marker, last."""
    from pyspark.sql import functions as F

    from dstl.spark.initial import (
        KEY_GROUP_COLUMN,
        STAGED_SCHEMA,
        StagedInitialState,
        StagedObject,
        attempt_prefix,
        forget,
        read_marker,
        stage_rows,
        write_marker,
    )
    from dstl.spark.query import has_batches

    store = ready.store
    if has_batches(store):
        forget(store)  # left by a driver that stopped before deleting it
        return
    if read_marker(store) is not None:
        return  # staged by an earlier driver: the first batch's plan may name it
    started = time.monotonic()
    forget(store)  # objects of a staging that did not finish
    key_type = df.schema[key_column].dataType
    key = F.col(f"`{key_column}`").cast(key_type)
    hashed = key if key_type.typeName() == "binary" else key.cast("string")
    kg = F.pmod(F.xxhash64(hashed), F.lit(max_parallelism)).cast("int")
    packed = initial_state.select(key.alias(key_column),
                         F.struct(*[F.col(f"`{c}`") for c in initial_state.columns]).alias(
                             INITIAL_STATE_COLUMN),
                         kg.alias(KEY_GROUP_COLUMN))
    pid = F.expr(f"cast(({KEY_GROUP_COLUMN} * {partitions}) div "
                 f"{max_parallelism} as int)")
    cfg, prefix = ready.task_config, attempt_prefix()

    def task(batches: Any) -> Any:
        from dstl.spark.runtime import runtime_for

        return stage_rows(runtime_for(cfg).storage.store, prefix, batches, max_parallelism,
                          partitions)

    task.__name__ = task.__qualname__ = plan_name(name) + "_initial_state"
    rows = (packed.withColumn("_dstl_pid", pid).repartitionById(partitions, "_dstl_pid")
            .mapInArrow(task, STAGED_SCHEMA).collect())
    staged = write_marker(store, StagedInitialState(tuple(
        StagedObject(r["object"], int(r["kg_start"]), int(r["kg_end"])) for r in rows)))
    logger.info("operator %s: initial state staged for the first batch in %d objects "
                "(%.2fs)", name, len(staged.objects), time.monotonic() - started)


def with_observed_metrics(routed: Any, task: Any, out_schema: Any, observation: str) -> Any:
    """``routed`` through the state tasks (``mapInArrow``: the output rows, then one metrics
    row per partition), each task's metrics rows feeding the query's observed metrics
    ``observation`` (:data:`dstl.spark.query.METRICS`), then left out: the output rows.
    The aggregates are SQL text, parsed in one py4j call each (a Column built in Python costs
    a dozen): the plan is built at every query start."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import ArrayType, LongType, StructField, StructType

    from dstl.spark.query import METRICS, METRICS_COLUMN

    schema = StructType([*out_schema.fields,
                         StructField(METRICS_COLUMN, ArrayType(LongType(), True), True)])
    aggregates = [F.expr(f"{agg}({METRICS_COLUMN}[{i}]) AS {m}")
                  for i, (m, (agg, _)) in enumerate(METRICS.items())]
    return (routed.mapInArrow(task, schema)
            .observe(observation, *aggregates)
            .where(F.col(METRICS_COLUMN).isNull())
            .drop(METRICS_COLUMN))


def plan_name(name: str) -> str:
    """The operator's name as it appears in Spark's query plan (the state tasks' UDF):
    ``dstl_`` and the name with every character that is not a letter, digit or ``_`` as ``_``."""
    return "dstl_" + re.sub(r"\W", "_", name)


def routing_sql(hashed: str, max_parallelism: int, partitions: int) -> str:
    """The partition of a key, in Spark SQL over the key's hashed form (a string or binary
    column expression): its key group (``pmod(xxhash64(...), max_parallelism)``, which is
    :func:`dstl.key_group_for`), scaled to the partitions as Flink does."""
    return (f"cast((pmod(xxhash64({hashed}), {max_parallelism}) * {partitions}) "
            f"div {max_parallelism} as int)")


def key_routing_sql(key_column: str, key_type: str, max_parallelism: int, partitions: int) -> str:
    """:func:`routing_sql` over the key column ``key_column`` of Spark type ``key_type``: a
    binary key is hashed as its bytes, any other as its string form."""
    key = f"`{key_column}`"
    hashed = key if key_type == "binary" else f"cast({key} as string)"
    return routing_sql(hashed, max_parallelism, partitions)
