"""Driver side of the Spark operator: ``DstlStatefulOperator.foreach_batch``.

Per micro-batch (``writeStream.foreachBatch(op.foreach_batch)``):

1. Route rows to partitions by key group inside the JVM — ``pmod(xxhash64(key), max_parallelism)``
   is :func:`dstl.key_group_for`, and the partition is Flink's ``key_group * P div
   max_parallelism`` — with ``repartitionById`` (no Python UDF for routing).
2. ``mapInArrow`` runs one task per partition (:func:`dstl.spark.task.run_partition`): state in an
   executor-local table, restored from the base checkpoint on a miss, the batch's changes made
   durable before the task returns, one metadata row per task with its backend handle.
3. The driver's :class:`~dstl.checkpoint.CheckpointCoordinator` collects the acknowledgements and
   writes the manifest for ``checkpoint_id = batch_id`` (the commit point; a re-run of a batch id
   writes a new attempt, so state updates are exactly-once), subsumes old checkpoints and
   deletes what no retained checkpoint needs.
4. The outputs go to the user's sink.

The base of batch N is the newest retained checkpoint below N, so a re-run of a batch starts from
the same state as the first run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from dstl.errors import ConfigError, UsageError
from dstl.options import DstlOptions
from materializer.options import BackendOptions

__all__ = ["DstlStatefulOperator"]

logger = logging.getLogger(__name__)

_KEY_TYPES = ("string", "binary", "int", "bigint", "smallint", "tinyint")


class DstlStatefulOperator:
    """A keyed stateful operator whose state lives in DSTL.

    Args:
        name: operator name (also the coordinator's job id and the prefix of partition ids).
        processor: a :class:`~dstl.spark.StatefulProcessor` subclass (instantiated per partition).
        key_column: the grouping column (string, binary or integer).
        output_schema: DDL of the rows ``handle_input_rows`` yields.
        state_uri: store root (``file://``, a path, ``s3://bucket/prefix``, ``hdfs://...``).
        partitions: number of Spark partitions (tasks) per batch.
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
        materialization_interval_s: a partition materializes at most this often (and when its
            log outgrows its snapshot, see ``BackendOptions.materialize_log_ratio``).
        local_dir: executor-local directory for tables and caches (default: SPARK_LOCAL_DIRS).
        agent: group-commit the segments of all tasks of an executor in one executor agent
            process (one object per executor per flush window); ``False``: each task writes its
            own segment (no extra process).
    """

    def __init__(self, *, name: str, processor: type, key_column: str, output_schema: str,
                 state_uri: str, partitions: int = 4, max_parallelism: int = 128,
                 table: str = "lmdb", sink: Callable[[Any, int], None] | None = None,
                 storage_options: Mapping[str, Any] | None = None,
                 options: DstlOptions | None = None,
                 backend_options: BackendOptions | None = None, retained: int = 3,
                 materialization_interval_s: float = 60.0, local_dir: str | None = None,
                 agent: bool = True) -> None:
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError("name", name, "a non-empty string without '/'",
                              owner="DstlStatefulOperator")
        if table not in ("lmdb", "heap"):
            raise ConfigError("table", table, "'lmdb' or 'heap'", owner="DstlStatefulOperator")
        if not isinstance(partitions, int) or not 1 <= partitions <= max_parallelism:
            raise ConfigError("partitions", partitions, f"an int in [1, max_parallelism="
                              f"{max_parallelism}]", owner="DstlStatefulOperator")
        if not isinstance(retained, int) or retained < 2:
            raise ConfigError("retained", retained, ">= 2 (a re-run batch restores from the "
                              "checkpoint before it)", owner="DstlStatefulOperator")
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
        self.materialization_interval_s = materialization_interval_s
        self.local_dir = local_dir
        self.agent = agent
        self._store: Any = None
        self._coordinator: Any = None
        self._cfg: Any = None
        self.batch_stats: list[dict[str, Any]] = []
        #: the executor agents' latest log lines, as reported with the last batch
        self.agent_logs: list[str] = []

    # ------------------------------------------------------------------ set-up

    def _ensure_ready(self, spark: Any) -> None:
        if self._coordinator is not None:
            return
        from dstl.checkpoint import CheckpointCoordinator
        from dstl.spark.task import META_COLUMN, OperatorConfig
        from dstl.stores import open_store

        conf = dict(spark.sparkContext.getConf().getAll())
        options = self._options or DstlOptions.from_mapping(conf, "spark.dstl.")
        backend_options = self._backend_options or _backend_options_from(conf)
        # A bad scheme, bucket or credentials fail here, before any batch runs.
        self._store = open_store(self.state_uri, self.storage_options, validate=True)
        self._coordinator = CheckpointCoordinator.recover(self._store, self.name,
                                                          retained=self.retained)
        out = spark.createDataFrame([], self.output_schema).schema
        import pyarrow as pa
        from pyspark.sql.pandas.types import to_arrow_schema

        arrow = to_arrow_schema(out)
        arrow = arrow.append(pa.field(META_COLUMN, pa.string()))
        self._cfg = OperatorConfig(
            name=self.name, processor=self.processor, key_column=self.key_column,
            output_columns=tuple(f.name for f in out.fields), arrow_schema=arrow,
            state_uri=self.state_uri, storage_options=self.storage_options,
            partitions=self.partitions, max_parallelism=self.max_parallelism, table=self.table,
            dstl_options=options, backend_options=backend_options,
            materialization_interval_s=self.materialization_interval_s,
            local_dir=self.local_dir, agent=self.agent)
        self._out_schema = out
        latest = self._coordinator.latest()
        logger.info("operator %s ready on %s (%s); last checkpoint: %s", self.name,
                    self._store.location, self.table,
                    latest.checkpoint_id if latest else "none")

    def validate(self, spark: Any) -> None:
        """Check the store and settings now (``foreach_batch`` does it on the first batch)."""
        self._ensure_ready(spark)

    @property
    def coordinator(self) -> Any:
        return self._coordinator

    # ------------------------------------------------------------------ per batch

    def foreach_batch(self, df: Any, batch_id: int) -> None:
        """Process one micro-batch (pass to ``writeStream.foreachBatch``)."""
        from pyspark.sql import functions as F

        from dstl.spark.task import META_COLUMN, TaskInput, run_partition

        t0 = time.monotonic()
        spark = df.sparkSession
        self._ensure_ready(spark)
        key_type = dict(df.dtypes).get(self.key_column)
        if key_type not in _KEY_TYPES:
            raise UsageError(f"key column {self.key_column!r} has type {key_type}; DSTL keys "
                             f"must be one of {', '.join(_KEY_TYPES)} (cast it first)")
        coord = self._coordinator
        retained = [m for m in coord.manifests()]
        base = max((m for m in retained if m.checkpoint_id < batch_id),
                   key=lambda m: m.checkpoint_id, default=None)
        if base is None and any(m.checkpoint_id >= batch_id for m in retained):
            raise UsageError(f"batch {batch_id} is older than every checkpoint in "
                             f"{self.state_uri} (oldest retained: "
                             f"{min(m.checkpoint_id for m in retained)}): this state belongs "
                             "to another query or Spark checkpoint; use a fresh state_uri")
        inp = TaskInput(batch_id=batch_id,
                        base_checkpoint=base.checkpoint_id if base is not None else -1,
                        base_handles={int(t.task_id[1:]): json.dumps(t.state)
                                      for t in base.tasks} if base is not None else {},
                        retained=tuple(sorted(m.checkpoint_id for m in retained)))
        tasks = [f"p{i}" for i in range(self.partitions)]
        cp = coord.trigger(tasks, checkpoint_id=batch_id)
        cfg = self._cfg
        key = f"`{self.key_column}`"
        hashed = key if key_type == "binary" else f"cast({key} as string)"
        pid = F.expr(f"cast((pmod(xxhash64({hashed}), {self.max_parallelism}) * "
                     f"{self.partitions}) div {self.max_parallelism} as int)")

        def task(batches: Any) -> Any:
            return run_partition(cfg, inp, batches)

        schema = f"{self._out_schema.simpleString()[7:-1]}, {META_COLUMN} string" \
            if self._out_schema.fields else f"{META_COLUMN} string"
        try:
            result = (df.withColumn("_dstl_pid", pid)
                      .repartitionById(self.partitions, "_dstl_pid")
                      .mapInArrow(task, schema)
                      .toArrow())
        except BaseException as exc:
            coord.abort(cp, f"batch {batch_id} failed: {type(exc).__name__}")
            raise
        t1 = time.monotonic()
        metas = [json.loads(m) for m in result.column(META_COLUMN).to_pylist() if m is not None]
        seen = {m["partition"] for m in metas}
        if seen != set(range(self.partitions)):
            coord.abort(cp, "missing task results")
            raise UsageError(f"batch {batch_id}: results of partitions "
                             f"{sorted(set(range(self.partitions)) - seen)} are missing")
        completion = None
        for m in metas:
            completion = coord.acknowledge(cp, f"p{m['partition']}", m["handle"],
                                           m["referenced_keys"], m["full_size"],
                                           m["incremental_size"]) or completion
        t2 = time.monotonic()
        import pyarrow.compute as pc

        outputs = result.filter(pc.is_null(result.column(META_COLUMN))).drop_columns(
            [META_COLUMN])
        if self.sink is not None:
            self.sink(spark.createDataFrame(outputs, schema=self._out_schema), batch_id)
        t3 = time.monotonic()
        st = [m["stats"] for m in metas]
        segments = sorted({k for s in st for k in s["segment_keys"]})
        agents = {int(s["agent"]["agent.pid"]): s["agent"] for s in st if s.get("agent")}
        self.agent_logs = [line for s in st for line in s.get("agent_log") or []][-10:]
        stats = {
            "batch_id": batch_id, "batch_seconds": t3 - t0, "job_seconds": t1 - t0,
            "commit_seconds": t2 - t1 + max((s["commit_seconds"] for s in st), default=0.0),
            "manifest_seconds": t2 - t1,
            "task_commit_seconds": max((s["commit_seconds"] for s in st), default=0.0),
            "sink_seconds": t3 - t2,
            "rows_in": sum(s["rows_in"] for s in st), "rows_out": outputs.num_rows,
            "segments": len(segments),
            "materializations": sum(s["materializations"] for s in st),
            "objects_written": len(segments) + sum(s["materializations"] for s in st) + 1,
            "bytes_written": sum(s["bytes"] + s["snapshot_bytes"] for s in st),
            "restores": sum(1 for s in st if s["access"] in ("restore", "rescale")),
            "restore_seconds": max((s["restore_seconds"] for s in st), default=0.0),
            "restore_seconds_total": sum(s["restore_seconds"] for s in st),
            "accesses": sorted(s["access"] for s in st),
            "deleted": len(completion.deleted) if completion is not None else 0,
            "agents": agents,
        }
        self.batch_stats.append(stats)
        logger.info("operator %s batch %d: %d rows in, %d out, %d objects, %.3fs",
                    self.name, batch_id, stats["rows_in"], stats["rows_out"],
                    stats["objects_written"], stats["batch_seconds"])

    def close(self) -> None:
        """Stop the coordinator (pending deletions finish) and release the store."""
        if self._coordinator is not None:
            self._coordinator.close()
            self._coordinator = None
        if self._store is not None:
            self._store.close()
            self._store = None


def _backend_options_from(conf: Mapping[str, str]) -> BackendOptions:
    prefix = "spark.dstl.backend."
    known = {f.name: f for f in fields(BackendOptions)}
    kwargs: dict[str, Any] = {}
    for k, raw in conf.items():
        if not k.startswith(prefix):
            continue
        name = k[len(prefix):]
        if name not in known:
            raise ConfigError(name, raw, f"one of {sorted(known)}", owner="spark.dstl.backend")
        default = getattr(BackendOptions(), name)
        try:
            if raw.lower() in ("none", ""):
                kwargs[name] = None
            elif isinstance(default, int) and not isinstance(default, bool):
                kwargs[name] = int(raw)
            else:
                kwargs[name] = float(raw)
        except ValueError as exc:
            raise ConfigError(name, raw, "a number or 'none'", owner="spark.dstl.backend") from exc
    return BackendOptions(**kwargs)
