"""Driver side of the Spark operator: ``DstlStatefulOperator.foreach_batch``.

Per micro-batch (``writeStream.foreachBatch(op.foreach_batch)``):

1. Route rows to partitions by key group inside the JVM — ``pmod(xxhash64(key), max_parallelism)``
   is :func:`dstl.key_group_for`, and the partition is Flink's ``key_group * P div
   max_parallelism`` — with ``repartitionById`` (no Python UDF for routing).
2. ``mapInArrow`` runs the partitions (:func:`dstl.spark.task.run_partition`): state in an
   executor-local table, restored from the base checkpoint on a miss, the batch's changes made
   durable before the task returns, one report row per partition
   (:class:`~dstl.spark.report.TaskReport`) with its backend handle. There is one Spark task
   per partition, or, with fewer task slots than partitions, one task per slot that runs
   partitions ``p ≡ task (mod tasks)`` one after another (:func:`dstl.spark.task.run_partitions`):
   a batch then runs in one wave of tasks instead of several, which saves each further wave's
   fixed cost (task launch, the hand-over to a Python worker and back).
3. The driver's :class:`~dstl.checkpoint.CheckpointCoordinator` collects the acknowledgements and
   writes the manifest for ``checkpoint_id = batch_id`` (the commit point; a re-run of a batch id
   writes a new attempt, so state updates are exactly-once), subsumes old checkpoints and
   deletes what no retained checkpoint needs.
4. The outputs go to the user's sink as a DataFrame of the rows the tasks made, kept on the
   executors (persisted): only the report rows reach the driver
   (:func:`dstl.spark.batch_job.run_batch_tasks`).

The base of batch N is the newest retained checkpoint below N, so a re-run of a batch starts from
the same state as the first run.

:class:`DstlStatefulOperator` plans and runs the batches; its other jobs live beside it: the
constructor's checks in :mod:`dstl.spark.operator_checks`, the session's settings in
:mod:`dstl.spark.session_conf`, a batch's base and times in :mod:`dstl.spark.batch_base`, the
batches' stats, progress and metrics endpoint in :mod:`dstl.spark.batch_record`, the
checkpoints of the batches inside the query in :mod:`dstl.spark.batch_commit`, what
:meth:`~DstlStatefulOperator.transform` adds to the user's plan in :mod:`dstl.spark.query_plan`,
and the Spark job of a ``foreach_batch`` batch in :mod:`dstl.spark.batch_job`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from dstl.checkpoint import CheckpointCoordinator
from dstl.checks import (
    check_int,
    check_optional_path,
)
from dstl.errors import (
    UsageError,
)
from dstl.options import DstlOptions
from dstl.retry import RetryPolicy
from dstl.spark.batch_base import BatchTime, driver_version, event_time_ms
from dstl.spark.batch_commit import InQueryCommits, Ready, acknowledge
from dstl.spark.batch_job import (
    batch_reports,
    run_batch_tasks,
    with_initial_state,
    without_adaptive_execution,
)
from dstl.spark.batch_record import BatchRecorder, BatchTimes, batch_stats
from dstl.spark.config import OperatorConfig, processor_id
from dstl.spark.jobdesc import BatchJobs, outcome_label, tasks_label
from dstl.spark.operator_checks import (
    OWNER,
    check_arguments,
    check_initial_state,
    check_time,
    spark_schema,
)
from dstl.spark.progress import ProgressListener
from dstl.spark.query_plan import (
    check_transform,
    key_routing_sql,
    late_rows_field,
    plan_name,
    routing_sql,
    stage_initial_state,
    with_observed_metrics,
)
from dstl.spark.report import REPORT_COLUMN
from dstl.spark.session_conf import (
    check_conf_unchanged,
    dstl_keys,
    dstl_runtime_conf,
    is_connect,
    session_time_zone,
    static_conf,
    with_interval,
)
from dstl.spark.stopping import stop_interruption
from dstl.spark.timing import (
    EVENT_TIME_COLUMN,
    HEARTBEAT_COLUMN,
)
from materializer.options import BackendOptions

__all__ = ["DstlStatefulOperator"]

logger = logging.getLogger(__name__)

_KEY_TYPES = ("string", "binary", "int", "bigint", "smallint", "tinyint")


def _without_heartbeat(df: Any) -> Any:
    """``df`` without the heartbeat rows and marker column of :func:`with_heartbeat`."""
    if HEARTBEAT_COLUMN not in df.columns:
        return df
    from pyspark.sql import functions as F

    return df.where(F.col(HEARTBEAT_COLUMN).isNull()).drop(HEARTBEAT_COLUMN)


class DstlStatefulOperator:
    """A keyed stateful operator whose state lives in DSTL.

    Args:
        name: operator name (also the coordinator's job id and the prefix of partition ids).
        processor: a :class:`~dstl.spark.StatefulProcessor` subclass (instantiated per partition).
        key_column: the grouping column (string, binary or integer).
        output_schema: DDL of the rows ``handle_input_rows`` yields.
        state_uri: store root (``file://``, a path, ``s3://bucket/prefix``, ``hdfs://...``).
        partitions: number of state partitions (backend handles, each a range of key groups).
        tasks: Spark tasks per batch, ``1 … partitions``; partition ``p`` runs in task
            ``p mod tasks``, a task's partitions one after another. ``None`` (default): one
            wave of tasks, ``min(partitions, sparkContext.defaultParallelism)`` (the cluster's
            task slots unless ``spark.default.parallelism`` says otherwise), read each batch.
        max_parallelism: number of key groups; fixed for the life of the state.
        table: ``"lmdb"`` (executor-local, shared by the executor's workers) or ``"heap"``
            (per worker process; for single-core executors).
        sink: ``sink(out_df, batch_id)`` receives each batch's output rows.
        storage_options: fsspec options (e.g. S3 endpoint, key, secret).
        options: :class:`~dstl.DstlOptions`; default: Spark conf ``spark.dstl.<field>``, else
            the defaults.
        backend_options: :class:`~materializer.BackendOptions`; default: Spark conf
            ``spark.dstl.backend.<field>``, else the defaults.
        retained: completed checkpoints kept (>= 2: a re-run of a batch needs the one before).
        materialization_interval_s: the ``BackendOptions.materialization_interval_s`` of this
            operator's backends — one setting, one meaning (``materializer/policy.py``): a
            partition's first materialization is due a random delay in ``[0, interval)`` after
            a worker (or the executor agent) takes it over, then ``interval`` after each
            attempt; ``0``: at every batch; ``None``: never by time (the size trigger,
            ``BackendOptions.materialize_log_ratio``, still applies). It replaces the value in
            ``backend_options``/``spark.dstl.backend.materialization_interval_s``, which must
            agree with it when set.
        local_dir: executor-local directory for tables and caches (default: SPARK_LOCAL_DIRS).
        agent: group-commit the segments of all tasks of an executor in one executor agent
            process (one object per executor per flush window); ``False``: each task writes its
            own segment (no extra process).
        time_mode: ``"none"`` (no timers), ``"processing_time"`` or ``"event_time"`` (Spark's
            ``"None"``, ``"ProcessingTime"``, ``"EventTime"`` too): what a timer's time means
            (:mod:`dstl.spark.timing`). ``event_time`` needs a watermark.
        event_time_column: the column with each row's event time (``timestamp``, or an integer
            column of epoch milliseconds); with ``watermark_delay``, the operator keeps a
            watermark: the largest event time seen in earlier batches minus the delay, never
            decreasing, stored in each checkpoint's manifest.
        watermark_delay: how late rows may be (seconds, a ``timedelta`` or ``"10 seconds"``).
        late_rows: rows at or below the batch's watermark: ``"drop"`` them, or
            ``"side_output"``: inside the query (:meth:`transform`) each late row is a row of
            the output DataFrame in the struct column ``late_column`` (the output columns
            null; output rows have it null); with :meth:`foreach_batch`, ``late_sink`` gets
            them.
        late_sink: ``late_sink(late_df, batch_id)`` (``foreach_batch`` with
            ``late_rows="side_output"``), after the batch's checkpoint and sink.
        late_column: the name of the late rows' struct column of :meth:`transform`'s output
            (``late_rows="side_output"``).
        initial_state: a (batch) DataFrame with the key column: in the first batch of a query
            without a checkpoint, each of its rows goes to the processor's
            ``handle_initial_state(key, initial_state, timer_values)`` (a dict of the row)
            before the batch's input; never again (a restart starts from its checkpoint).
            :meth:`transform` stages it in the store before the query starts
            (:mod:`dstl.spark.initial`).
        metrics_port: serve Prometheus metrics on this driver port (``0``: any free port;
            :attr:`metrics_port` then holds it); ``None`` (default): Spark conf
            ``spark.dstl.metrics.port``, else no endpoint. Needs ``prometheus_client``
            (``pip install 'dstl[metrics]'``); see :mod:`dstl.spark.prometheus`.
    """

    def __init__(self, *, name: str, processor: type, key_column: str, output_schema: str,
                 state_uri: str, partitions: int = 4, max_parallelism: int = 128,
                 table: str = "lmdb", sink: Callable[[Any, int], None] | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 options: DstlOptions | None = None,
                 backend_options: BackendOptions | None = None, retained: int = 3,
                 materialization_interval_s: float | None = 60.0, local_dir: str | None = None,
                 agent: bool = True, time_mode: str = "none",
                 event_time_column: str | None = None, watermark_delay: Any = None,
                 late_rows: str = "drop",
                 late_sink: Callable[[Any, int], None] | None = None,
                 late_column: str = "late_row", initial_state: Any = None,
                 metrics_port: int | None = None, tasks: int | None = None) -> None:
        check_arguments(name=name, processor=processor, key_column=key_column,
                         output_schema=output_schema, state_uri=state_uri,
                         partitions=partitions, max_parallelism=max_parallelism, table=table,
                         sink=sink, storage_options=storage_options, options=options,
                         backend_options=backend_options, retained=retained,
                         materialization_interval_s=materialization_interval_s,
                         local_dir=local_dir, agent=agent, tasks=tasks)
        self.time = check_time(time_mode, event_time_column, watermark_delay, late_rows,
                                late_sink, key_column, sink, late_column, output_schema)
        self.initial_state = check_initial_state(initial_state, processor, key_column)
        if metrics_port is not None:
            check_int(metrics_port, "metrics_port", OWNER, lo=0, hi=65535,
                      fix="a TCP port for the driver's Prometheus endpoint, or None")
        self.metrics_port = metrics_port
        self.tasks = tasks
        self.name = name
        self.processor = processor
        self.key_column = key_column
        self.output_schema = output_schema
        self.state_uri = state_uri
        self.partitions = partitions
        self.max_parallelism = max_parallelism
        self.table = table
        self.sink = sink
        self.storage_options = dict(storage_options) if storage_options else None
        self._options = options
        self._backend_options = backend_options
        self.retained = retained
        self.materialization_interval_s = (None if materialization_interval_s is None
                                           else float(materialization_interval_s))
        self.local_dir = check_optional_path(local_dir, "local_dir", OWNER)
        self.agent = agent
        self._ready: Ready | None = None
        #: (session, listener) once :meth:`transform` added its query listener
        self._listener: tuple[Any, Any] | None = None
        #: held by a batch and by a warm-up: their tasks never run at the same time, so a
        #: warm-up's restore never touches a table a batch task is writing (and a warm-up
        #: between batches finds every table at the next base: hit or adopt)
        self._tasks_lock = threading.Lock()
        #: the batches' stats, progress records and metrics endpoint
        self._recorder = BatchRecorder(name, partitions, table)
        #: the checkpoints of :meth:`transform`'s batches
        self._commits = InQueryCommits(partitions, self.time, self._recorder,
                                       lambda: self._ready)
        #: the processing-time clock, epoch ms (the driver's wall clock; tests replace it)
        self.clock_ms: Callable[[], int] = lambda: int(time.time() * 1000)
        #: the batches' base and times (reads the clock above, which tests replace)
        self._batch_time = BatchTime(self.time, state_uri, lambda: self.clock_ms())

    # ------------------------------------------------------------------ set-up

    def _ensure_ready(self, spark: Any) -> Ready:
        if self._ready is not None:
            return self._ready
        from dstl.stores import open_store

        static = static_conf(spark)
        conf = {**static, **dstl_runtime_conf(spark)}
        from dstl.spark.registration import enable_filter_pushdown

        # spark.read.format("dstl") is known to every session (pyspark_dstl); its filters
        # reach the source with this on
        enable_filter_pushdown(spark)
        out = spark_schema(spark, self.output_schema)
        config = self._task_config(conf, out, session_time_zone(spark))
        # A bad scheme, bucket or credentials fail here, before any batch runs. The driver's
        # reads and deletes retry as the tasks' do.
        store = open_store(self.state_uri, self.storage_options, validate=True,
                           retry=RetryPolicy.for_store(config.dstl_options))
        try:
            coordinator = CheckpointCoordinator.recover(store, self.name,
                                                        retained=self.retained)
        except BaseException:
            store.close()
            raise
        try:
            self.metrics_port = self._recorder.start_exporter(self.metrics_port, conf)
        except BaseException:
            coordinator.close()
            store.close()
            raise
        self._ready = Ready(store, coordinator, config, out, dstl_keys(static),
                             dstl_keys(conf))
        latest = coordinator.latest()
        logger.info("operator %s ready on %s (%s); last checkpoint: %s", self.name,
                    store.location, self.table, latest.checkpoint_id if latest else "none")
        if static.get("spark.python.daemon.module") != "dstl.spark.daemon":
            logger.info("operator %s: the executors fork Python workers from %s; with "
                        "spark.python.daemon.module=dstl.spark.daemon (a static conf, set "
                        "before the session starts; docs/configuration.md) a worker starts "
                        "with DSTL imported and pyspark's bytecode cached, and the executor "
                        "agent starts ahead", self.name,
                        static.get("spark.python.daemon.module", "pyspark.daemon"))
        return self._ready

    def _task_config(self, conf: Mapping[str, str], out_schema: Any,
                     time_zone: str = "UTC") -> OperatorConfig:
        """What every task gets: the settings, and the Arrow schema of its output and report
        rows (timestamps as UTC instants, which is what Spark reads back from Arrow)."""
        import pyarrow as pa
        from pyspark.sql.pandas.types import to_arrow_schema

        arrow = to_arrow_schema(out_schema, timezone="UTC").append(
            pa.field(REPORT_COLUMN, pa.string()))
        return OperatorConfig(
            name=self.name, processor=self.processor, key_column=self.key_column,
            output_columns=tuple(f.name for f in out_schema.fields), arrow_schema=arrow,
            state_uri=self.state_uri, storage_options=self.storage_options,
            partitions=self.partitions, max_parallelism=self.max_parallelism, table=self.table,
            dstl_options=self._options or DstlOptions.from_mapping(conf, "spark.dstl."),
            backend_options=with_interval(self._backend_options, conf,
                                           self.materialization_interval_s),
            local_dir=self.local_dir, agent=self.agent, time_mode=self.time.mode,
            session_time_zone=time_zone, processor_id=processor_id(self.processor))

    def validate(self, spark: Any) -> None:
        """Check the store and settings now (``foreach_batch`` does it on the first batch)."""
        self._ensure_ready(spark)

    def warm_up(self, spark: Any) -> dict[str, Any]:
        """Before the query starts: start the executors' Python workers and agents and restore
        every partition at the newest checkpoint (the next batch's base), in parallel over the
        executor cores, so the first batch after a restart finds its state instead of restoring
        it behind worker start-up (:mod:`dstl.spark.warmup`). Optional; safe if the prediction
        is wrong (the batch restores as usual). It waits for a running batch of this operator
        (and a batch waits for it): their tasks never overlap. A failed warm-up is logged and returned
        (``error``), not raised: the first batch then restores, and fails, as it would have.

        Returns:
            ``base_checkpoint``, ``seconds`` (wall time of the warm-up job) and ``partitions``:
            per partition how it got its state (``access``) and whether its table is adoptable
            (``marked``).
        """
        with self._tasks_lock:  # never while a batch of this operator runs
            return self._warm_up(spark)

    def _warm_up(self, spark: Any) -> dict[str, Any]:
        from dstl.spark.warmup import WARM_UP_SCHEMA, warm_partition

        started = time.monotonic()
        ready = self._ensure_ready(spark)
        latest = ready.coordinator.latest()
        task_input = self._batch_time.task_input(ready.coordinator,
                                      latest.checkpoint_id + 1 if latest is not None else 0)
        cfg = ready.task_config

        def task(batches: Any) -> Any:
            return warm_partition(cfg, task_input, batches)

        out: dict[str, Any] = {"base_checkpoint": task_input.base_checkpoint}
        # Shaped like a batch's job: rows routed through the batch's routing expression and a
        # repartitionById shuffle into mapInArrow, with AQE off (row p goes to task p, which
        # warms partition p). So the session's first batch also finds its shuffle, routing
        # code and post-shuffle Arrow path warm, not only the workers: measured, ~50 ms less
        # in the first batch after a restart than a warm-up job without the shuffle.
        p = self.partitions
        rows_df = spark.range(0, p, 1, p).selectExpr(
            "cast(id as int) as _dstl_pid",
            f"{routing_sql('cast(id as string)', self.max_parallelism, p)} as _dstl_routed")
        try:
            with without_adaptive_execution(spark):
                rows = (rows_df.repartitionById(p, "_dstl_pid").mapInArrow(task, WARM_UP_SCHEMA)
                        .toArrow().to_pylist())
            out["partitions"] = {int(r["partition"]): json.loads(r["outcome"]) for r in rows}
        except Exception as exc:  # noqa: BLE001 - reported; the first batch restores instead
            logger.warning("operator %s: warm-up failed (the first batch restores instead): "
                           "%s: %s", self.name, type(exc).__name__, str(exc)[:2000])
            out["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        out["seconds"] = time.monotonic() - started
        logger.info("operator %s warmed up at checkpoint %s in %.2fs", self.name,
                    task_input.base_checkpoint, out["seconds"])
        return out

    @property
    def coordinator(self) -> CheckpointCoordinator | None:
        """The driver's checkpoint coordinator (``None`` before the first batch or
        :meth:`validate`, and after :meth:`close`)."""
        return self._ready.coordinator if self._ready is not None else None

    # ------------------------------------------------------------------ per batch

    @property
    def batch_stats(self) -> list[dict[str, Any]]:
        """Per batch: rows, objects, bytes, accesses, seconds per phase, agents' metrics; the
        last ``RECENT_PROGRESS`` batches (older entries are dropped: the driver stays flat)."""
        return self._recorder.batch_stats

    @property
    def agent_logs(self) -> list[str]:
        """The executor agents' latest log lines, as reported with the last batch."""
        return self._recorder.agent_logs

    @property
    def last_progress(self) -> dict[str, Any] | None:
        """The last batch's progress record (shaped like Spark's ``StreamingQueryProgress``,
        :mod:`dstl.spark.progress`); ``None`` before the first batch."""
        return self._recorder.progress.last

    @property
    def recent_progress(self) -> list[dict[str, Any]]:
        """The last (at most ``RECENT_PROGRESS`` = 100) batches' progress records, oldest
        first."""
        return self._recorder.progress.recent

    def add_listener(self, listener: ProgressListener) -> None:
        """Call ``listener(progress)`` after each batch (after the sink returned); an exception
        it raises is logged and ignored.

        Raises:
            ConfigTypeError: not callable.
        """
        self._recorder.add_listener(listener)

    def remove_listener(self, listener: ProgressListener) -> bool:
        """Stop calling ``listener``; whether it was registered."""
        return self._recorder.remove_listener(listener)

    def __call__(self, df: Any) -> Any:
        """``df.transform(op)``: the same as :meth:`transform`."""
        return self.transform(df)

    def transform(self, df: Any) -> Any:
        """The operator inside the query: a streaming DataFrame of the processor's rows, to
        chain with more DataFrame operations and write with any sink
        (``op.transform(df).writeStream...``; ``df.transform(op)`` is the same).

        The rows are routed by key group in the JVM and the state tasks run in the query's own
        micro-batches; their outputs go straight to what follows in the query, never through
        the driver. State is exactly-once with Spark's commit: the tasks of a batch agree on
        its base and times through write-once objects in the store, and a batch's checkpoint
        is taken from the results of the attempt Spark committed (:mod:`dstl.spark.query`;
        docs/spark.md, "Inside the query"). With an ``initial_state`` and no state yet, this
        call first stages it in the store (one batch job; :mod:`dstl.spark.initial`), and the
        query's first batch applies it. With ``late_rows="side_output"`` the late rows are
        rows of the returned DataFrame too, in the struct column ``late_column`` (null on the
        processor's rows, whose columns are null on late rows): split them with a filter, e.g.
        in ``foreachBatch``. The driver writes the checkpoint's manifest when
        Spark reports the batch (a ``StreamingQueryListener`` this call adds to the session),
        or, after a driver crash, when the operator starts again. Each batch's figures are in
        the query's observed metrics, ``lastProgress["observedMetrics"]["dstl.<name>"]``
        (:data:`dstl.spark.query.METRICS`). Works from a Spark Connect client too.

        Raises:
            UsageError: ``df`` is not a streaming DataFrame, or the operator has a ``sink`` or
                a ``late_sink`` (those belong to :meth:`foreach_batch`).
        """
        from pyspark.sql import functions as F

        from dstl.spark.query import run_in_query

        check_transform(df, self.name, self.sink is not None, self.time.late_sink is not None,
                        self.time.late_column)
        spark = df.sparkSession
        ready = self._ensure_ready(spark)
        self._commits.commit_pending(ready)
        df = _without_heartbeat(df)
        key_type = self._key_type(df)
        with_initial = self.initial_state is not None
        if with_initial:
            stage_initial_state(ready, df, self.initial_state, self.key_column, self.partitions,
                                self.max_parallelism, self.name)
        late_field, out_schema = None, ready.out_schema
        if self.time.late_rows == "side_output":
            late_field, out_schema = late_rows_field(df, out_schema, self.time.late_column)
        event_column = self.time.event_time_column
        if event_column is not None:
            df = df.withColumn(EVENT_TIME_COLUMN, event_time_ms(df, event_column))
        tasks = self._task_count(spark)
        pid = F.expr(key_routing_sql(self.key_column, key_type, self.max_parallelism,
                                     self.partitions))
        cfg, delay_ms = ready.task_config, self.time.delay_ms
        event_time, version = event_column is not None, driver_version()

        def task(batches: Any) -> Any:
            return run_in_query(cfg, tasks, delay_ms, event_time, version, batches, late_field,
                                with_initial)

        # the name Spark's plan (SQL tab, explain) shows for the state tasks' node
        task.__name__ = task.__qualname__ = plan_name(self.name)

        self._listen(spark)
        return with_observed_metrics(
            df.withColumn("_dstl_pid", pid).repartitionById(tasks, "_dstl_pid"), task,
            out_schema, f"dstl.{self.name}")

    def wait_for_checkpoint(self, batch_id: int, timeout_s: float = 60.0) -> bool:
        """Wait until the checkpoint of batch ``batch_id`` (or a later one) is written: inside
        the query the driver writes it when Spark reports the batch, on the listener's thread
        (e.g. ``op.wait_for_checkpoint(query.lastProgress["batchId"])`` after
        ``awaitTermination``, before reading the state). Whether it was written in time."""
        return self._commits.wait_for_checkpoint(batch_id, timeout_s)

    def _listen(self, spark: Any) -> None:
        """Add the listener that commits each batch Spark reports (once per session)."""
        from dstl.spark.query_listener import BatchListener

        if self._listener is not None:
            return
        listener = BatchListener(self)
        spark.streams.addListener(listener)
        self._listener = (spark, listener)

    def on_batch_committed(self, batch_id: int, query_id: str,
                           duration_ms: float = 0.0) -> None:
        """Spark committed micro-batch ``batch_id`` of query ``query_id``: if that query runs
        :meth:`transform`, write the checkpoints of the batch and of every earlier committed
        batch not written yet. Called by the query listener; idempotent."""
        self._commits.on_batch_committed(batch_id, query_id, duration_ms)

    def foreach_batch(self, df: Any, batch_id: int) -> None:
        """Process one micro-batch (pass to ``writeStream.foreachBatch``).

        Raises:
            BatchInterruptedError: the query is stopping (``query.stop()`` during the batch);
                Spark ends the query as stopped and runs the batch again at the next start
                (:mod:`dstl.spark.stopping`).
            UsageError: ``late_rows="side_output"`` without a ``late_sink`` (its late rows
                have nowhere to go here; :meth:`transform` puts them in its output).
        """
        if self.time.late_rows == "side_output" and self.time.late_sink is None:
            raise UsageError(f"operator {self.name!r} has late_rows='side_output' and no "
                             "late_sink: foreach_batch hands late rows to "
                             "late_sink(late_df, batch_id); pass one, or run the operator "
                             "inside the query (op.transform), whose output carries them in "
                             f"its {self.time.late_column!r} column")
        if is_connect(df.sparkSession):
            raise UsageError(f"operator {self.name!r}: foreach_batch runs its state job from "
                             "the driver's SparkContext, which a Spark Connect client does "
                             "not have; use out = op.transform(df) (or df.transform(op)) and "
                             "write out with writeStream")
        try:
            with self._tasks_lock:  # a warm-up of this operator never runs meanwhile
                self._batch(df, batch_id)
        except Exception as exc:
            stopped = stop_interruption(exc, self.name, batch_id,
                                        getattr(df, "sparkSession", None))
            if stopped is None:
                raise
            # without its context: Spark's stop test is a regex whose recursion overflows the
            # query thread's stack on a long traceback (a Java stack trace in the context)
            raise stopped from None

    def _batch(self, df: Any, batch_id: int) -> None:
        from pyspark.sql import functions as F

        started = time.monotonic()
        wall_start = time.time()
        ready = self._ensure_ready(df.sparkSession)
        df = _without_heartbeat(df)
        check_conf_unchanged(self.name, ready.conf, ready.static_conf, df.sparkSession,
                             batch_id)
        key_type = self._key_type(df)
        task_input = self._batch_time.task_input(ready.coordinator, batch_id)
        df, late_df = self._batch_time.split_late(df, task_input.watermark_ms)
        initial = self.initial_state is not None and task_input.base_checkpoint < 0
        if initial:
            # no checkpoint yet: the query's first batch
            df = with_initial_state(df, self.initial_state, self.key_column)
        tasks = self._task_count(df.sparkSession)
        with BatchJobs(df.sparkSession.sparkContext, self.name, batch_id) as jobs:
            jobs.label(tasks_label(self.partitions, task_input.base_checkpoint, initial, tasks))
            checkpoint_id = ready.coordinator.trigger(
                [f"p{i}" for i in range(self.partitions)], checkpoint_id=batch_id)
            kept, report_rows = run_batch_tasks(
                ready, df, key_type, task_input, checkpoint_id, tasks, name=self.name,
                key_column=self.key_column, partitions=self.partitions,
                max_parallelism=self.max_parallelism, keep_outputs=self.sink is not None)
            try:
                tasks_done = time.monotonic()
                reports = batch_reports(ready.coordinator, checkpoint_id, report_rows,
                                        self.partitions)
                next_wm = self._batch_time.commit_properties(ready.coordinator, checkpoint_id,
                                                  task_input, reports)
                completion = acknowledge(ready.coordinator, checkpoint_id, reports)
                acknowledged = time.monotonic()
                jobs.label(outcome_label(checkpoint_id, reports, completion is not None))
                if kept is not None and self.sink is not None:
                    self.sink(kept.where(F.col(REPORT_COLUMN).isNull()).drop(REPORT_COLUMN),
                              batch_id)
                if late_df is not None and self.time.late_sink is not None:
                    self.time.late_sink(late_df, batch_id)
            finally:
                if kept is not None:
                    kept.unpersist(blocking=False)
            rows_out = sum(r.rows_out for r in reports)
        times = BatchTimes(started, tasks_done, acknowledged, time.monotonic())
        stats = batch_stats(batch_id, reports, completion, rows_out, times)
        stats.update(processing_time_ms=task_input.processing_time_ms,
                     watermark_ms=task_input.watermark_ms, next_watermark_ms=next_wm)
        self._recorder.record(ready.coordinator, stats, reports, wall_start)

    # ------------------------------------------------------------------ time

    def _key_type(self, df: Any) -> str:
        """The key column's Spark type.

        Raises:
            UsageError: not a type DSTL keys by.
        """
        key_type = dict(df.dtypes).get(self.key_column)
        if key_type not in _KEY_TYPES:
            raise UsageError(f"key column {self.key_column!r} has type {key_type}; DSTL keys "
                             f"must be one of {', '.join(_KEY_TYPES)} (cast it first)")
        return str(key_type)

    def _task_count(self, spark: Any) -> int:
        """Spark tasks of this batch: ``tasks``, else one per task slot (at most one per
        partition)."""
        if self.tasks is not None:
            return self.tasks
        if is_connect(spark):  # a Spark Connect client sees no SparkContext
            slots = spark.conf.get("spark.default.parallelism", None)
            return max(1, min(self.partitions, int(slots))) if slots else self.partitions
        return max(1, min(self.partitions, int(spark.sparkContext.defaultParallelism)))

    def close(self) -> None:
        """Stop the coordinator (pending deletions finish), the metrics endpoint, and release
        the store."""
        listening, self._listener = self._listener, None
        if listening is not None:
            spark, listener = listening
            try:
                spark.streams.removeListener(listener)
            except Exception as exc:  # noqa: BLE001 - a stopped session has no listeners left
                logger.info("operator %s: query listener not removed: %s", self.name, exc)
        self._recorder.close()
        with self._commits.lock:
            ready, self._ready = self._ready, None
        if ready is not None:
            ready.coordinator.close()
            ready.store.close()
