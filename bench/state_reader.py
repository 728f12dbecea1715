"""State reader benchmark: reading N keys of state with ``spark.read.format("dstl")``
vs Spark's own ``spark.read.format("statestore")`` on the same state, in the same run; and the
change feed's lag and throughput while the job writes.

The state: count per key, keys ``k%08d``, each key written once over B batches (text file
source, ``maxFilesPerTrigger=1``, ``availableNow``; 200 k keys per batch up to 1 M keys, 500 k
beyond, 100 k in ``--quick``), ``local[2]``, 4 partitions, 128 key groups — the job shape of
``bench/restart.py``. The state is built here by two queries over the same input files:

* DSTL — ``DstlStatefulOperator`` (LMDB tables, the executor agent) with a ``count`` value state;
  ``--snapshots`` off (default ``both``): materialization off, the reader replays the log;
  on: ``materialization_interval_s=1``, the reader loads snapshots (+ the log tail);
* Spark — ``groupBy("key").count()`` in update mode on ``RocksDBStateStoreProvider`` with
  changelog checkpointing (``minDeltasForSnapshot=1``, ``maintenanceInterval=1s`` when snapshots
  are on), sink ``noop``.

Read figure: wall time of one read of the whole state, every column, into Spark's ``noop`` sink
(``df.write.format("noop")``) — DSTL: ``spark.read.format("dstl").option("operator", "count")``
(one split per partition; values as JSON), Spark: ``spark.read.format("statestore")`` on the
query's checkpoint; and DSTL's read of the three columns Spark's reader gives (``key``, the count
as ``typed_value bigint``, ``partition``: ``.schema(SPARK_COLUMNS)``, so only those are built and
handed over). Reads rotate among the five (with the two floors below), ``--repeats`` each
(median, spread), after one unmeasured warm-up read of each. The reads are checked: as many
rows as keys, counts summing to the keys. Floor: the same read of a Python data source with
DSTL's schema whose splits yield record batches built before the read (no state read at all):
what Spark's Python Data Source plumbing costs for as many rows — the floor under the DSTL
source (of all ten columns, and of the three).

Change feed: a ``dstl_changes`` stream (processing-time trigger 0.5 s, ``foreachBatch`` counting
its rows) runs while the DSTL job processes ``--feed-batches`` more batches of new keys
(processing-time trigger 1 s). Lag = when the consumer's batch holding checkpoint ``c`` finished
minus the commit time of ``c``'s manifest (read while the job runs: one sample per new
checkpoint, at least five); throughput = change rows / seconds the consumer spent in its
batches.

Run: ``nice -n 10 .venv/bin/python bench/state_reader.py [--quick] [--keys 1000000,4000000]
[--snapshots both|on|off] [--repeats 5] [--daemon] [--split-cpu N]`` (``--repeats`` >= 5, also
in ``--quick``; ``--split-cpu``: N reads of one split in the bench process, no Spark;
``--daemon``: the session runs DSTL's Python daemon, :data:`DAEMON_CONF`). The machine is shared:
load averages are recorded with every figure.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    add_render,
    fmt,
    parser,
    publish,
    render_stored,
    summary,
    table,
    tree_cpu_s,
)
from dstl.spark.processor import StatefulProcessor, StatefulProcessorHandle  # noqa: E402

PARTITIONS = 4
MAX_PARALLELISM = 128
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


class Count(StatefulProcessor):
    """Rows per key (one value state)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.get_value_state("count")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        c = (self.count.get() or 0) + sum(1 for _ in rows)
        self.count.update(c)
        yield {"key": key, "count": c}


def _session(local_dir: str, snapshots: bool, extra: dict[str, str] | None = None) -> Any:
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get(
        "PYTHONPATH", "")) if p)
    b = (SparkSession.builder.master("local[2]").appName("dstl-bench-state-reader")
         .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.memory", "3g").config("spark.sql.shuffle.partitions", PARTITIONS)
         .config("spark.local.dir", local_dir)
         .config("spark.python.authenticate.socketTimeout", "120s")  # a loaded, shared host
         .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
         .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true"))
    if snapshots:
        b = (b.config("spark.sql.streaming.stateStore.minDeltasForSnapshot", "1")
             .config("spark.sql.streaming.stateStore.maintenanceInterval", "1s"))
    for k, v in (extra or {}).items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _write_inputs(src: Path, keys: int, per_batch: int, first: int = 0) -> int:
    """Text files of keys ``first..keys-1``, ``per_batch`` per file; returns the file count."""
    src.mkdir(parents=True, exist_ok=True)
    n = 0
    for start in range(first, keys, per_batch):
        stop = min(keys, start + per_batch)
        existing = len(list(src.iterdir()))
        (src / f"part-{existing:05d}.txt").write_text(
            "".join(f"k{i:08d}\n" for i in range(start, stop)))
        n += 1
    return n


def _build(spark: Any, work: Path, keys: int, per_batch: int, snapshots: bool
           ) -> tuple[str, str, dict[str, Any]]:
    """Run both jobs over the same files; the DSTL state_uri and the Spark checkpoint."""
    from dstl.spark import DstlStatefulOperator

    src = work / "src"
    files = _write_inputs(src, keys, per_batch)
    uri, dstl_ck, spark_ck = str(work / "state"), str(work / "dstl-ck"), str(work / "spark-ck")
    op = DstlStatefulOperator(name="count", processor=Count, key_column="key",
                              output_schema="key string, count long", state_uri=uri,
                              partitions=PARTITIONS, max_parallelism=MAX_PARALLELISM,
                              materialization_interval_s=1.0 if snapshots else None,
                              local_dir=str(work / "local"), sink=lambda df, b: None)
    stream = (spark.readStream.option("maxFilesPerTrigger", 1).text(str(src))
              .withColumnRenamed("value", "key"))
    t0 = time.monotonic()
    q = (stream.writeStream.foreachBatch(op.foreach_batch).option("checkpointLocation", dstl_ck)
         .trigger(availableNow=True).start())
    q.awaitTermination()
    t1 = time.monotonic()
    q2 = (stream.groupBy("key").count().writeStream.outputMode("update").format("noop")
          .option("checkpointLocation", spark_ck).trigger(availableNow=True).start())
    q2.awaitTermination()
    t2 = time.monotonic()
    if snapshots:
        time.sleep(3)  # let the maintenance thread upload the last snapshot
    op.close()
    return uri, spark_ck, {"files": files, "dstl_build_s": t1 - t0, "spark_build_s": t2 - t1,
                           "batch_stats": op.batch_stats}


#: DSTL's columns with what Spark's ``statestore`` reader gives (its ``key``, ``value`` — the
#: count as a bigint — and ``partition_id``): a user-specified schema, so the source builds and
#: hands over only these
SPARK_COLUMNS = "key string, typed_value bigint, partition string"


def _noop_read(reader: Any, ddl: str | None, load: Callable[[Any], Any]) -> float:
    """Seconds to read ``load(reader)`` (with the user-specified schema ``ddl``, if given) into
    Spark's ``noop`` sink."""
    t0 = time.monotonic()
    load(reader if ddl is None else reader.schema(ddl)).write.format("noop").mode(
        "overwrite").save()
    return time.monotonic() - t0


def _read_dstl(spark: Any, uri: str, ddl: str | None = None) -> float:
    return _noop_read(spark.read.format("dstl"), ddl,
                      lambda r: r.option("operator", "count").load(uri))


def _read_spark(spark: Any, ck: str) -> float:
    t0 = time.monotonic()
    spark.read.format("statestore").load(ck).write.format("noop").mode("overwrite").save()
    return time.monotonic() - t0


def _check(spark: Any, uri: str, ck: str, keys: int) -> None:
    from pyspark.sql import functions as F

    d = spark.read.format("dstl").option("operator", "count").load(uri)
    n, total = d.agg(F.count("*"), F.sum(d.value.cast("long"))).first()
    s = spark.read.format("statestore").load(ck)
    m = s.count()
    c = spark.read.format("dstl").schema(SPARK_COLUMNS).option("operator", "count").load(uri)
    nc, total_c = c.agg(F.count("*"), F.sum(c.typed_value)).first()
    if (n, total, m, nc, total_c) != (keys, keys, keys, keys, keys):
        raise SystemExit(f"state check failed: DSTL {n} rows summing to {total} ({nc} rows "
                         f"summing to {total_c} with {SPARK_COLUMNS!r}), Spark {m} rows; "
                         f"expected {keys}")


def _floor_source() -> Any:
    """A Python data source with DSTL's state schema whose splits yield record batches built
    before the read (the same row count, 4 splits, realistic keys and values): what Spark's
    Python Data Source plumbing alone costs — the Python worker, the Arrow hand-over, the rows
    in the JVM — with no state read at all. The floor under any Python source of this table."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    from dstl.reader.arrow import STATE_DDL

    class FloorReader(DataSourceReader):
        def __init__(self, rows: int, batch: int, columns: list[str]) -> None:
            self.rows = rows
            self.batch = batch
            self.columns = columns

        def partitions(self) -> list[InputPartition]:
            return [InputPartition(i) for i in range(PARTITIONS)]

        def read(self, partition: InputPartition) -> Iterator[Any]:
            yield from _floor_batches(self.rows // PARTITIONS, int(partition.value), self.batch,
                                      self.columns)

    class FloorSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "dstl_bench_floor"

        def schema(self) -> str:
            return STATE_DDL

        def reader(self, schema: Any) -> DataSourceReader:
            return FloorReader(int(self.options["rows"]), int(self.options.get("batch", 16384)),
                               schema.fieldNames())  # DSTL's, or a user-specified subset

    return FloorSource


def _floor_batches(rows: int, part: int, batch: int = 16384,
                   columns: list[str] | None = None) -> Iterator[Any]:
    import pyarrow as pa

    from dstl.reader.arrow import STATE_SCHEMA

    n = min(rows, batch)
    kb = pa.array([b"k%08d" % i for i in range(n)], type=pa.binary())
    cols = [pa.repeat(pa.scalar(5, pa.int64()), n), pa.repeat(pa.scalar(f"p{part}"), n),
            pa.array([i % MAX_PARALLELISM for i in range(n)], type=pa.int32()),
            kb.cast(pa.string()), kb, pa.repeat(pa.scalar("count"), n),
            pa.repeat(pa.scalar("value"), n), pa.nulls(n, pa.string()), pa.nulls(n, pa.string()),
            pa.repeat(pa.scalar("1"), n)]
    full = pa.RecordBatch.from_arrays(cols, schema=STATE_SCHEMA)
    if columns is not None:  # typed_value: the count as bigint (valueType)
        full = full.append_column("typed_value", pa.repeat(pa.scalar(1, pa.int64()), n))
        full = full.select(columns)
    for start in range(0, rows, n):
        yield full.slice(0, min(n, rows - start))


def _read_floor(spark: Any, keys: int, ddl: str | None = None) -> float:
    return _noop_read(spark.read.format("dstl_bench_floor"), ddl,
                      lambda r: r.option("rows", keys).load())


def _reads(spark: Any, uri: str, ck: str, repeats: int, keys: int) -> dict[str, Any]:
    spark.dataSource.register(_floor_source())
    reads: dict[str, Callable[[], float]] = {
        "dstl": lambda: _read_dstl(spark, uri), "spark": lambda: _read_spark(spark, ck),
        "floor": lambda: _read_floor(spark, keys),
        "dstl_cols": lambda: _read_dstl(spark, uri, SPARK_COLUMNS),
        "floor_cols": lambda: _read_floor(spark, keys, SPARK_COLUMNS)}
    for read in reads.values():  # warm-up: Python workers, JIT, page cache
        read()
    wall: dict[str, list[float]] = {name: [] for name in reads}
    cpu: dict[str, list[float]] = {name: [] for name in reads}
    loads: list[float] = []
    order = list(reads)
    for i in range(repeats):
        for name in order[i % len(order):] + order[:i % len(order)]:  # rotated each round
            before = tree_cpu_s()
            wall[name].append(reads[name]())
            cpu[name].append(tree_cpu_s() - before)
        loads.append(os.getloadavg()[0])
    d, s = summary(wall["dstl"]), summary(wall["spark"])
    dc = summary(wall["dstl_cols"])
    return {"dstl_read_s": d, "spark_read_s": s, "ratio_spark_over_dstl":
            s["median"] / d["median"], "floor_read_s": summary(wall["floor"]),
            "dstl_cols_read_s": dc, "ratio_spark_over_dstl_cols": s["median"] / dc["median"],
            "floor_cols_read_s": summary(wall["floor_cols"]),
            "cpu_s": {name: summary(v) for name, v in cpu.items()},
            "loadavg_1m": summary(loads)}


class _Consumer:
    """foreachBatch of the change-feed stream: rows and finish time per batch."""

    def __init__(self) -> None:
        self.batches: list[dict[str, float]] = []
        self.lock = threading.Lock()

    def __call__(self, df: Any, batch_id: int) -> None:
        from pyspark.sql import functions as F

        t0 = time.monotonic()
        row = df.agg(F.count("*"), F.max("checkpoint"), F.min("checkpoint")).first()
        with self.lock:
            self.batches.append({"rows": row[0], "max": -1 if row[1] is None else row[1],
                                 "min": -1 if row[2] is None else row[2], "start": t0,
                                 "end": time.monotonic(), "wall_end": time.time()})


def _commit_times(store: Any, seen: dict[int, int]) -> None:
    """Add the commit time (ms) of every manifest in ``store`` not in ``seen`` yet."""
    from dstl.checkpoint.manifest import decode_manifest
    from dstl.errors import ObjectNotFoundError
    from dstl.layout import parse_manifest_key

    for info in store.list("checkpoints/"):
        parsed = parse_manifest_key(info.key)
        if parsed is None or parsed[0] in seen:
            continue
        try:
            m = decode_manifest(store.get(info.key), info.key)
        except ObjectNotFoundError:
            continue  # deleted by retention between the listing and the read
        seen[m.checkpoint_id] = m.created_ms


def _feed(spark: Any, work: Path, uri: str, keys: int, per_batch: int, batches: int,
          snapshots: bool, op_build_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The change feed while the DSTL job writes ``batches`` more batches of new keys."""
    from dstl.spark import DstlStatefulOperator, register
    from dstl.stores import open_store

    register(spark)
    src = work / "src"
    op = DstlStatefulOperator(name="count", processor=Count, key_column="key",
                              output_schema="key string, count long", state_uri=uri,
                              partitions=PARTITIONS, max_parallelism=MAX_PARALLELISM,
                              materialization_interval_s=1.0 if snapshots else None,
                              local_dir=str(work / "local2"), sink=lambda df, b: None)
    consumer = _Consumer()

    start = max(s["batch_id"] for s in op_build_stats) if op_build_stats else -1

    def start_feed() -> Any:
        # an explicit start: a consumer restarted before its first offset was written must not
        # re-evaluate "latest"
        return (spark.readStream.format("dstl_changes").option("operator", "count")
                .option("startingCheckpoint", start).load(uri)
                .writeStream.foreachBatch(consumer)
                .option("checkpointLocation", str(work / "feed-ck"))
                .trigger(processingTime="500 milliseconds").start())

    feed_q = start_feed()
    restarts = 0
    job_q = (spark.readStream.option("maxFilesPerTrigger", 1).text(str(src))
             .withColumnRenamed("value", "key").writeStream.foreachBatch(op.foreach_batch)
             .option("checkpointLocation", str(work / "dstl-ck"))
             .trigger(processingTime="1 second").start())
    first_new = len(op.batch_stats)
    _write_inputs(src, keys + batches * per_batch, per_batch, first=keys)
    deadline = time.monotonic() + 1800
    last_cp = None
    # commit times are read while the job runs: retention deletes older manifests
    watch = open_store(uri)
    commit_ms: dict[int, int] = {}
    while time.monotonic() < deadline:
        _commit_times(watch, commit_ms)
        if feed_q.exception() is not None and restarts < 3:
            # Spark's fixed 10 s for a new Python process to connect back is too short on a
            # loaded host; the consumer resumes from its checkpoint
            print(f"  change feed consumer failed ({str(feed_q.exception())[:80]}); restarting",
                  flush=True)
            restarts += 1
            feed_q = start_feed()
        if len(op.batch_stats) >= first_new + batches:
            last_cp = op.batch_stats[-1]["batch_id"]
            with consumer.lock:
                if any(b["max"] >= last_cp for b in consumer.batches):
                    break
        time.sleep(0.2)
    job_q.stop()
    feed_q.stop()
    op.close()
    _commit_times(watch, commit_ms)
    watch.close()
    if last_cp is None:
        raise SystemExit("change feed: the job or the consumer did not finish in 30 min")
    lags = []
    for b in consumer.batches:
        for cid in range(b["min"], b["max"] + 1):
            if cid in commit_ms and b["rows"]:
                lags.append(b["wall_end"] - commit_ms[cid] / 1000)
    rows = sum(b["rows"] for b in consumer.batches)
    busy = sum(b["end"] - b["start"] for b in consumer.batches if b["rows"])
    if rows != batches * per_batch:
        raise SystemExit(f"change feed: {rows} rows for {batches * per_batch} new keys")
    return {"lag_s": summary(lags), "rows": rows, "rows_per_s": rows / busy,
            "consumer_batches": len(consumer.batches), "consumer_restarts": restarts,
            "job_batch_s": summary([s["batch_seconds"] for s in op.batch_stats])}


def _sorted_table(t: Any) -> Any:
    return t.sort_by([(name, "ascending") for name in t.column_names])


def _dump(uri: str, path: str, repeats: int) -> dict[str, Any]:
    """``dstl state dump`` of the whole state, in this process (no Spark): CPU seconds of the
    row path (``read_state``, heap table, as before) and of the column path (what the command
    runs now), JSON lines and Parquet; the outputs are checked equal (same lines, same rows)."""
    from argparse import Namespace

    import pyarrow.parquet as pq

    from dstl.cli import state as cli
    from dstl.reader import CheckpointCatalog, open_read_only, read_state

    out: dict[str, list[float]] = {}
    with open_read_only(uri) as store:
        catalog = CheckpointCatalog(store)
        args = Namespace(checkpoint=None, key=None, state=None, allow_pickle=False,
                         output=path, action="dump")
        runs: dict[str, Callable[[], int]] = {
            "jsonl rows": lambda: cli._jsonl(read_state(catalog), path),
            "jsonl columns": lambda: cli._jsonl_columns(catalog, args),
            "parquet rows": lambda: cli._parquet(read_state(catalog), path, "dump"),
            "parquet columns": lambda: cli._parquet_columns(catalog, args)}
        seen: dict[str, Any] = {}
        for i in range(repeats):
            for name, fn in (runs.items() if i % 2 == 0 else reversed(runs.items())):
                t0 = time.process_time()
                fn()
                out.setdefault(name, []).append(time.process_time() - t0)
                if i == 0:
                    seen[name] = (sorted(Path(path).read_text().splitlines())
                                  if name.startswith("jsonl") else
                                  _sorted_table(pq.read_table(path)))
    if seen["jsonl rows"] != seen["jsonl columns"] or not seen["parquet rows"].equals(
            seen["parquet columns"]):
        raise SystemExit("dstl state dump: the row and column paths wrote different output")
    return {name: summary(v) for name, v in out.items()}


def _split_cpu(uri: str, repeats: int) -> dict[str, Any]:
    """CPU seconds, and nanoseconds per entry, of reading one split's three columns
    (:data:`SPARK_COLUMNS`) column-wise in this process (no Spark): what a split read costs an
    executor's Python worker, over the splits in turn."""
    import pyarrow as pa

    from dstl.reader import CheckpointCatalog, open_read_only
    from dstl.reader.columns import read_state_batches
    from dstl.reader.read import plan_state_read

    cpu: list[float] = []
    ns: list[float] = []
    with open_read_only(uri) as store:
        splits, _ = plan_state_read(CheckpointCatalog(store), None, None, None)
        for i in range(repeats):
            t0 = time.process_time()
            n = sum(b.num_rows for b in read_state_batches(
                store, splits[i % len(splits)], columns=["key", "typed_value", "partition"],
                typed=("typed_value", pa.int64()), batch_rows=16384))
            cpu.append(time.process_time() - t0)
            ns.append(cpu[-1] / max(n, 1) * 1e9)
    return {"cpu_s": summary(cpu), "ns_per_entry": summary(ns), "splits": len(splits)}


#: ``--daemon``: the executors' Python daemon is DSTL's, preloading what a read task imports
#: (docs/configuration.md, "The Python daemon")
DAEMON_CONF = {
    "spark.python.daemon.module": "dstl.spark.daemon",
    "spark.executorEnv.DSTL_DAEMON_PRELOAD":
        "pyspark.sql.worker.plan_data_source_read,dstl.spark.datasource,dstl.reader.columns",
}


def run_size(keys: int, snapshots: bool, repeats: int, quick: bool,
             dump: int = 0, daemon: bool = False, split_cpu: int = 0) -> dict[str, Any]:
    per_batch = 100_000 if quick else (200_000 if keys <= 1_000_000 else 500_000)
    work = Path(tempfile.mkdtemp(prefix="dstl-bench-reader-"))
    spark = _session(str(work / "spark-local"), snapshots, DAEMON_CONF if daemon else None)
    try:
        from dstl.spark import register

        register(spark)
        uri, ck, build = _build(spark, work, keys, per_batch, snapshots)
        _check(spark, uri, ck, keys)
        out = {"keys": keys, "snapshots": snapshots, "daemon": daemon, "build": build,
               **_reads(spark, uri, ck, repeats, keys)}
        if split_cpu:
            out["split_cpu"] = _split_cpu(uri, split_cpu)
            print(f"  one split in process: {fmt(out['split_cpu']['cpu_s'], 's')} CPU, "
                  f"{fmt(out['split_cpu']['ns_per_entry'], 'ns', digits=0)} per entry",
                  flush=True)
        if dump:
            out["dump_cpu_s"] = _dump(uri, str(work / "dump.out"), dump)
            print(f"  dstl state dump: {out['dump_cpu_s']}", flush=True)
        shown = {k: v for k, v in build.items() if k != "batch_stats"}
        print(f"  build: {shown}; read: DSTL {fmt(out['dstl_read_s'], 's')}, Spark "
              f"{fmt(out['spark_read_s'], 's')}", flush=True)
        feed_batches = 5  # lag: one sample per checkpoint, so at least five
        stats = build.pop("batch_stats")
        out["feed"] = _feed(spark, work, uri, keys, per_batch // 4, feed_batches, snapshots,
                            stats)
        return out
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


def markdown(figures: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures."""
    rows = []
    for r in figures["results"]:
        ratio = r["ratio_spark_over_dstl_cols"]
        rows.append([f"{r['keys']:,}" + (" (DSTL daemon)" if r.get("daemon") else ""),
                     fmt(r["dstl_cols_read_s"], "s"), fmt(r["spark_read_s"], "s"),
                     f"**{ratio:.2f}x**", fmt(r["floor_cols_read_s"], "s"),
                     f"{fmt(r['dstl_read_s'], 's')} ({r['ratio_spark_over_dstl']:.2f}x)",
                     ">= 1x: " + ("met" if ratio >= 1 else "**missed**")])
    lags = "; ".join(f"{fmt(r['feed']['lag_s'], 's')} at {r['keys']:,} keys"
                     for r in figures["results"])
    return "\n".join([
        table(["keys", "DSTL read, Spark's 3 columns", "Spark `format(\"statestore\")` (same run)",
               "Spark / DSTL", "floor, 3 columns", "DSTL, all 10 columns (Spark / DSTL)", "goal"],
              rows), "",
        "A whole-state read into the `noop` sink, the same state written by both engines; "
        "DSTL reads Spark's three columns via `.schema(...)`; floor = a Python data source of "
        f"prebuilt rows. Median (min..max) of {figures['repeats']} reads. Change feed lag: "
        f"{lags}.",
    ])


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--keys", default=None, help="comma-separated key counts (default: 1 M, 4 M; "
                                                "quick: 200 k)")
    p.add_argument("--snapshots", choices=("both", "on", "off"), default="both")
    p.add_argument("--dump", type=int, default=0,
                   help="also time `dstl state dump` (row vs column path, JSON lines and "
                        "Parquet) this many times each, in this process")
    p.add_argument("--split-cpu", type=int, default=0, metavar="N",
                   help="also time N column-wise reads of one split (Spark's three columns) "
                        "in this process, no Spark: CPU per split and per entry")
    p.add_argument("--daemon", action="store_true",
                   help="run the session with DSTL's Python daemon (spark.python.daemon.module="
                        "dstl.spark.daemon), preloading the reader's modules")
    add_render(p)
    args = p.parse_args()
    if args.render:
        render_stored("state_reader", Path(args.render), markdown)
        return
    sizes = [int(k) for k in args.keys.split(",")] if args.keys else (
        [200_000] if args.quick else [1_000_000, 4_000_000])
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.snapshots]
    if args.repeats < 5:
        p.error("--repeats must be >= 5 (medians of at least five reads)")
    repeats = args.repeats
    results = []
    for keys in sizes:
        for snap in modes:
            print(f"state reader: {keys:,} keys, snapshots {'on' if snap else 'off'}",
                  flush=True)
            r = run_size(keys, snap, repeats, args.quick, args.dump, args.daemon,
                         args.split_cpu)
            print(f"  DSTL {fmt(r['dstl_read_s'], 's')}  Spark {fmt(r['spark_read_s'], 's')}  "
                  f"ratio {r['ratio_spark_over_dstl']:.2f}; same columns: DSTL "
                  f"{fmt(r['dstl_cols_read_s'], 's')} ratio "
                  f"{r['ratio_spark_over_dstl_cols']:.2f}; feed lag "
                  f"{fmt(r['feed']['lag_s'], 's')}, {r['feed']['rows_per_s']:,.0f} rows/s",
                  flush=True)
            results.append(r)
    cmd = "nice -n 10 python bench/state_reader.py" + (" --quick" if args.quick else "") + (
        f" --keys {args.keys}" if args.keys else "") + (
        f" --snapshots {args.snapshots}" if args.snapshots != "both" else "") + (
        f" --dump {args.dump}" if args.dump else "") + (
        f" --split-cpu {args.split_cpu}" if args.split_cpu else "") + (
        " --daemon" if args.daemon else "")
    publish("state_reader", {"results": results, "repeats": repeats}, markdown,
            quick=args.quick, command=cmd, no_doc=args.no_doc, tag=args.tag)


if __name__ == "__main__":
    main()
