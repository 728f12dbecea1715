"""The Spark job of a :meth:`DstlStatefulOperator.foreach_batch
<dstl.spark.operator.DstlStatefulOperator.foreach_batch>` batch.

The batch's rows (with the ``initial_state`` rows in a query's first batch,
:func:`with_initial_state`) are routed to partitions by key group in the JVM and run through the
state tasks in one job with adaptive execution off (:func:`run_batch_tasks`,
:func:`without_adaptive_execution`); the output rows stay persisted on the executors for the
sink, and only the report rows reach the driver, where :func:`batch_reports` validates them. A
failed job is translated where its text says more than Spark's wrapper: executors without DSTL
or with another version (:func:`deployment_problem`), an output row that does not fit the
output schema (:func:`task_output_error`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dstl.checkpoint import CheckpointCoordinator
from dstl.errors import OutputSchemaError, UsageError
from dstl.spark.batch_commit import Ready
from dstl.spark.config import TaskInput
from dstl.spark.query_plan import key_routing_sql
from dstl.spark.report import INITIAL_STATE_COLUMN, REPORT_COLUMN, TaskReport, TaskReportError

__all__ = ["ADAPTIVE", "batch_reports", "deployment_problem", "run_batch_tasks",
           "task_output_error", "with_initial_state", "without_adaptive_execution"]


def with_initial_state(df: Any, initial_state: Any, key_column: str) -> Any:
    """``df`` plus one row per row of ``initial_state``: its key (cast to the input's key
    type) and the whole row packed into the ``INITIAL_STATE_COLUMN`` struct (null on input
    rows), so both are routed by key in one job."""
    from pyspark.sql import functions as F

    key_type = df.schema[key_column].dataType
    packed = initial_state.select(F.col(f"`{key_column}`").cast(key_type).alias(key_column),
                         F.struct(*[F.col(f"`{c}`") for c in initial_state.columns]).alias(
                             INITIAL_STATE_COLUMN))
    struct_type = packed.schema[INITIAL_STATE_COLUMN].dataType
    return df.withColumn(INITIAL_STATE_COLUMN, F.lit(None).cast(struct_type)).unionByName(
        packed, allowMissingColumns=True)


def run_batch_tasks(ready: Ready, df: Any, key_type: str, task_input: TaskInput,
                    checkpoint_id: int, tasks: int, *, name: str, key_column: str,
                    partitions: int, max_parallelism: int,
                    keep_outputs: bool) -> tuple[Any, list[str]]:
    """Route the rows to partitions by key group in the JVM and run the partitions in
    ``tasks`` Spark tasks. Returns the tasks' rows kept on the executors (``None``
    unless ``keep_outputs``: the operator has a sink) and their report rows (JSON text, one per
    partition: the only rows the driver receives). A failed job aborts the checkpoint.

    The output rows stay where the tasks made them: the job's result is persisted
    (memory, spilling to disk) and only the report column comes to the driver, so a batch's
    output is bounded by the executors' storage, not by ``spark.driver.maxResultSize`` or
    the driver's memory; the sink then reads the persisted rows (its own job, on the
    executors). The caller unpersists them once the sink returned. If a persisted block is
    lost before the sink reads it (its executor died), Spark computes that partition
    again: a task of the same batch on the same base, which a re-run partition already is
    (:mod:`dstl.spark.task`), whose report the driver never reads."""
    from pyspark import StorageLevel
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType, StructField, StructType

    from dstl.spark.task import run_partition, run_partitions

    cfg = ready.task_config
    pid = F.expr(key_routing_sql(key_column, key_type, max_parallelism, partitions))

    def task(batches: Any) -> Any:
        return run_partition(cfg, task_input, batches)

    def grouped_task(batches: Any) -> Any:
        return run_partitions(cfg, task_input, batches, tasks)

    schema = StructType([*ready.out_schema.fields,
                         StructField(REPORT_COLUMN, StringType(), True)])
    kept = None
    try:
        with without_adaptive_execution(df.sparkSession):
            # repartitionById takes the partition modulo ``tasks``: p -> task p mod tasks
            result = (df.withColumn("_dstl_pid", pid)
                      .repartitionById(tasks, "_dstl_pid")
                      .mapInArrow(task if tasks == partitions else grouped_task,
                                  schema))
            if keep_outputs:
                # planned here, with AQE off: the cache keeps this plan
                kept = result = result.persist(StorageLevel.MEMORY_AND_DISK)
            reports = [r[0] for r in result.where(F.col(REPORT_COLUMN).isNotNull())
                       .select(REPORT_COLUMN).collect()]
        return kept, reports
    except BaseException as exc:
        if kept is not None:
            kept.unpersist(blocking=False)
        ready.coordinator.abort(checkpoint_id, f"batch {checkpoint_id} failed: {type(exc).__name__}")
        deployment = deployment_problem(str(exc))
        if deployment is not None:
            raise UsageError(f"operator {name!r}, batch {checkpoint_id}: "
                             f"{deployment}") from exc
        typed = task_output_error(exc)
        if typed is not None:
            raise typed from exc
        raise


def batch_reports(coordinator: CheckpointCoordinator, checkpoint_id: int, rows: list[str],
                  partitions: int) -> list[TaskReport]:
    """One report per partition (of ``partitions``), validated.

    Raises:
        UsageError: a partition's report is missing; TaskReportError: one is malformed
            (either aborts the checkpoint).
    """
    try:
        reports = [TaskReport.from_json(r) for r in rows]
    except TaskReportError:
        coordinator.abort(checkpoint_id, "malformed task report")
        raise
    missing = set(range(partitions)) - {r.partition for r in reports}
    if missing:
        coordinator.abort(checkpoint_id, "missing task results")
        raise UsageError(f"batch {checkpoint_id}: results of partitions {sorted(missing)} are missing")
    return reports


#: Spark's switch for adaptive query execution (AQE).
ADAPTIVE = "spark.sql.adaptive.enabled"


@contextmanager
def without_adaptive_execution(spark: Any) -> Iterator[None]:
    """Plan and run the state tasks' job with AQE off; the session's setting is given back
    after, also when the job fails.

    With AQE on (Spark's default, and it stays on inside ``foreachBatch``), the routing shuffle
    runs as a job of its own (the map stage), the plan is optimized again, and the state tasks
    run as a second job: two job submissions and a re-planning per batch, for nothing AQE could
    change here (``repartitionById`` fixes the partition count, and a task must see exactly its
    partition's rows, so neither coalescing nor skew splits may apply). With AQE off it is one
    job of two stages, as Spark's own stateful operators run (Structured Streaming plans them
    without AQE). The switch is read when the plan is made (``persist``, the reports' ``collect``); it is set on
    the batch's session (under Structured Streaming the query's own clone of the user's), so
    another thread planning on that same session during the job would plan without AQE too.
    """
    conf = spark.conf
    previous = conf.get(ADAPTIVE, None)
    if previous is not None and str(previous).strip().lower() == "false":
        yield  # already off: nothing to set or give back
        return
    conf.set(ADAPTIVE, "false")
    try:
        yield
    finally:
        if previous is None:
            conf.unset(ADAPTIVE)
        else:
            conf.set(ADAPTIVE, previous)


def deployment_problem(error_text: str) -> str | None:
    """What a failed job's error says about the executors' DSTL, if anything: a version other
    than the driver's, or none at all (the user's code runs, DSTL cannot be imported)."""
    from dstl.spark.task import VERSION_MISMATCH

    for line in error_text.splitlines():
        if VERSION_MISMATCH in line:
            return line[line.index(VERSION_MISMATCH):][:800]
    if "No module named 'dstl'" in error_text or "No module named 'materializer'" in \
            error_text:
        return ("the executors' Python cannot import DSTL (No module named 'dstl'): set "
                "PYSPARK_PYTHON to an interpreter that has the driver's DSTL installed, or ship "
                "it with a packed virtualenv (--archives) or a container image (docs/deploy.md)")
    return None


#: How an executor's OutputSchemaError appears in the text of the Spark job's failure.
_OUTPUT_ERROR_RE = re.compile(r"(?:dstl\.errors\.)?OutputSchemaError: (.+)")


def task_output_error(exc: BaseException) -> OutputSchemaError | None:
    """The executor's :class:`OutputSchemaError` (its message) when it failed the Spark job,
    else None: Spark wraps a Python worker's exception in its own, as text."""
    if isinstance(exc, OutputSchemaError):
        return exc
    m = _OUTPUT_ERROR_RE.search(str(exc))
    return OutputSchemaError(m.group(1).strip()) if m else None
