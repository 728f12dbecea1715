"""Inside the query: ``op.transform(df)`` against Spark's ``transformWithStateInPandas`` (TWS) on
RocksDB with changelog checkpointing — steady batches on a 2-executor cluster, one batch of many
output rows, and a restart.

The logic, written twice (:class:`RunningCount` for DSTL, :func:`_spark_processor` for Spark's
API): per key a running count in one value state; each batch emits ``(key, count)`` once per key
it saw. Input: text files of keys, one file per micro-batch (``maxFilesPerTrigger=1``,
``trigger(availableNow=True)``). Variants (:func:`_query`):

* ``dstl``    — ``op.transform(df)`` (LMDB tables, the executor agent, 4 partitions, defaults
  otherwise) written by Spark's Parquet file sink;
* ``dstl-fb`` — the same operator through ``foreachBatch(op.foreach_batch)``, its sink
  ``df.write.mode("append").parquet(...)``;
* ``tws``     — ``groupBy("key").transformWithStateInPandas(..., "Append", "None")`` on
  ``RocksDBStateStoreProvider`` with ``changelogCheckpointing.enabled=true``, 4 shuffle
  partitions, written by the Parquet file sink (the sink of ``dstl``);
* ``count``   — Spark's ``groupBy("key").count()`` (update mode, same state store; a file sink
  takes append mode only, so ``foreachBatch`` writes Parquet): a JVM-only floor, for context.

Figures:

1. **Steady batch** on ``local-cluster[2,1,1024]`` (two executor JVMs of one core each,
   ``tests/support/spark_cluster.py``): B batches of R rows over K keys, every variant's query in
   the same cluster, order rotated per repeat. Per batch ``triggerExecution`` from
   ``recentProgress`` and the CPU seconds of the whole process tree (driver, its JVM, the
   executor JVMs, Python workers, DSTL's agents) between consecutive progress reports; steady =
   all but the first batch; cell = median over repeats of the per-repeat median.
2. **One batch of many output rows** (same cluster shape; one child process, so one driver, per
   variant and repeat): a small first batch (worker start-up), then a batch of ``--tws-keys``
   new keys (both engines), then, DSTL only, a batch of ``--big-keys`` new keys (each key one
   output row). Per batch ``triggerExecution``, and the driver's RSS — the driver Python process
   plus its JVM, from ``/proc`` every 50 ms — peak during the batch minus the last sample before
   it. On a cluster the executors are processes of their own, so the driver's RSS shows only what
   reaches the driver (in ``local[2]`` the executor lives in the driver's JVM). TWS runs one state
   RPC per key from Python to the JVM: a 1 M-key batch takes about an hour on this machine, so
   TWS runs the smaller batch only (the table names its size).
3. **Restart** (``local[2]``): the state is built once per variant and size (DSTL: 1 M keys and
   the TWS size; TWS: its size, see 2), then each repeat is a new process that starts a fresh
   SparkSession on a fresh copy of the Spark checkpoint and DSTL store, with an empty
   executor-local directory (all state comes from the store / the checkpoint), and processes one
   batch of 2,000 existing keys. The figure: from the new query's start (before ``readStream``;
   DSTL opens its store there) to the end of that first batch (the progress report's start +
   ``triggerExecution``) — nothing before the batch is left out. ``dstl-daemon`` is ``dstl`` with
   ``spark.python.daemon.module=dstl.spark.daemon`` (docs/configuration.md).

Correctness: every query's output is read back and compared with an independent computation
(steady: every ``(key, count)`` row against a model of the files; big batch: every key once with
count 1; build: every key with count 1; restart: exactly the restart keys, each with count 2), so
a wrong run fails instead of looking fast.

Each measurement runs in a child process (``--child``, its arguments and result as JSON files),
the parent orchestrates, samples the load average and writes the results. Run:
``.venv/bin/python bench/in_query.py [--quick]`` (quick: tiny sizes, 1 repeat;
``--render bench/results/in_query-<date>-<commit>.json`` rewrites the docs section from a stored run).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    LoadSampler,
    fmt,
    other_jvms,
    parser,
    summary,
    tree_cpu_s,
    write_results,
)
from dstl.spark import StatefulProcessor as DstlProcessor  # noqa: E402

NAME = "in_query"
OUTPUT = "key string, count long"
PARTITIONS = 4
MAX_PARALLELISM = 128
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
SPARK_STATE_CONF = {
    "spark.sql.shuffle.partitions": str(PARTITIONS),
    "spark.sql.streaming.stateStore.providerClass": ROCKSDB_PROVIDER,
    "spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled": "true"}
STEADY_VARIANTS = ("dstl", "dstl-fb", "tws", "count")
BIG_VARIANTS = ("dstl", "dstl-fb", "tws")
#: the first batch of the big-batch queries: starts the Python workers, out of the figure
WARM_KEYS = 200
#: keys per file when building a state (one file = one batch)
BUILD_KEYS_PER_BATCH = 200_000
#: the driver's RSS is sampled this often during the big batches
RSS_INTERVAL_S = 0.05
#: mtime of file 0 of a source; file i is i seconds later (the file source takes files in
#: modification-time order)
MTIME_BASE = 1_700_000_000


# ----------------------------------------------------------------- the logic, twice


class RunningCount(DstlProcessor):
    """DSTL: rows per key so far (one value state), emitted once per key per batch."""

    def init(self, handle: Any) -> None:
        self.count = handle.get_value_state("count")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]], timer_values: Any
                          ) -> Iterator[dict[str, Any]]:
        c = (self.count.get() or 0) + sum(1 for _ in rows)
        self.count.update(c)
        yield {"key": key, "count": c}


def _spark_processor() -> Any:
    """Spark's version (a class made on demand: pyspark's base class imports Spark). One
    ``get`` and one ``update`` per key (``get`` answers ``None`` for a new key, so no
    ``exists`` call)."""
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class SparkRunningCount(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.count = handle.getValueState("count", "count long")

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            import pandas as pd

            n = sum(len(pdf) for pdf in rows)
            old = self.count.get()
            c = (int(old[0]) if old is not None else 0) + n
            self.count.update((c,))
            yield pd.DataFrame({"key": [key[0]], "count": [c]})

        def close(self) -> None:
            """Nothing to release: the state is Spark's."""

    return SparkRunningCount()


# ----------------------------------------------------------------- input files


def write_keys(src: Path, index: int, keys: list[str]) -> None:
    """File ``index`` of a source (whole files only; modification time orders them)."""
    from bench.restart import write_lines

    src.mkdir(parents=True, exist_ok=True)
    path = src / f"part-{index:05d}.txt"
    write_lines(path, keys)
    os.utime(path, (MTIME_BASE + index, MTIME_BASE + index))


def steady_files(batches: int, rows: int, keys: int, seed: int) -> list[list[str]]:
    rng = random.Random(seed)
    return [[f"u{rng.randrange(keys):05d}" for _ in range(rows)] for _ in range(batches)]


def running_count_model(files: list[list[str]]) -> Counter[tuple[str, int]]:
    """The ``(key, count)`` rows a running count emits over ``files`` (one batch each)."""
    seen: Counter[str] = Counter()
    out: Counter[tuple[str, int]] = Counter()
    for f in files:
        for k, n in Counter(f).items():
            seen[k] += n
            out[(k, seen[k])] += 1
    return out


# ----------------------------------------------------------------- sessions and queries


def _python_paths() -> None:
    """Spark's Python workers run this interpreter and import this module by reference (the
    DSTL processor class)."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))


def cluster_session(root: Path) -> Any:
    """``local-cluster[2,1,1024]`` with Spark's RocksDB store and changelog checkpointing."""
    sys.path.insert(0, str(ROOT / "tests"))
    from support.spark_cluster import new_cluster_session

    _python_paths()
    return new_cluster_session("bench-in-query", root, conf=dict(SPARK_STATE_CONF))


def local_session(root: Path, daemon: bool) -> Any:
    """``local[2]`` with Spark's RocksDB store and changelog checkpointing; ``daemon``: workers
    forked from ``dstl.spark.daemon``."""
    from pyspark.sql import SparkSession

    _python_paths()
    (root / "spark-local").mkdir(parents=True, exist_ok=True)
    b = (SparkSession.builder.master("local[2]").appName("bench-in-query")
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.memory", "1g")
         .config("spark.local.dir", str(root / "spark-local")))
    for k, v in SPARK_STATE_CONF.items():
        b = b.config(k, v)
    if daemon:
        b = b.config("spark.python.daemon.module", "dstl.spark.daemon")
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _parquet_sink(out: Path) -> Callable[[Any, int], None]:
    def sink(df: Any, batch_id: int) -> None:
        df.write.mode("append").parquet(str(out))
    return sink


class _ProgressCpu:
    """CPU seconds of the whole process tree (and DSTL's agents, which are detached) at each
    progress report of a query: a batch's CPU is the difference to the previous report."""

    def __init__(self, spark: Any, root: Path) -> None:
        from pyspark.sql.streaming.listener import StreamingQueryListener

        self.at: dict[int, float] = {}
        self.root = root
        outer = self

        class Listener(StreamingQueryListener):
            def onQueryStarted(self, event: Any) -> None:
                outer.at[-1] = outer.cpu()

            def onQueryProgress(self, event: Any) -> None:
                outer.at[int(event.progress.batchId)] = outer.cpu()

            def onQueryIdle(self, event: Any) -> None:
                pass

            def onQueryTerminated(self, event: Any) -> None:
                pass

        self.spark, self.listener = spark, Listener()
        spark.streams.addListener(self.listener)

    def cpu(self) -> float:
        from support.spark_cluster import processes_under

        tick = os.sysconf("SC_CLK_TCK")
        agents = 0
        for p in processes_under([self.root]):
            if p.kind == "agent":
                with contextlib.suppress(OSError, ValueError, IndexError):
                    f = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                    agents += sum(int(x) for x in f[11:15])
        return tree_cpu_s() + agents / tick

    def close(self) -> None:
        self.spark.streams.removeListener(self.listener)


def _operator(mod: Any, work: Path, local_dir: Path | None,
              sink: Callable[[Any, int], None] | None = None) -> Any:
    from dstl.spark import DstlStatefulOperator

    return DstlStatefulOperator(
        name="count", processor=mod.RunningCount, key_column="key", output_schema=OUTPUT,
        state_uri=str(work / "state"), partitions=PARTITIONS, max_parallelism=MAX_PARALLELISM,
        table="lmdb", sink=sink, local_dir=str(local_dir) if local_dir else None)


def _query(spark: Any, variant: str, src: Path, work: Path, local_dir: Path | None,
           cpu_root: Path | None = None) -> dict[str, Any]:
    """Run ``variant`` over every file of ``src`` not yet processed (checkpoint
    ``work/ck``, output ``work/out``); its per-batch progress."""
    mod: Any = importlib.import_module("bench.in_query")
    out_dir = work / "out"
    cpu = _ProgressCpu(spark, cpu_root) if cpu_root is not None else None
    op: Any = None
    t_query_start = time.time()  # the query's start: before DSTL opens its store
    try:
        stream = (spark.readStream.option("maxFilesPerTrigger", 1).text(str(src))
                  .withColumnRenamed("value", "key"))
        if variant == "dstl":
            op = _operator(mod, work, local_dir)
            writer = (op.transform(stream).writeStream.format("parquet")
                      .option("path", str(out_dir)))
        elif variant == "dstl-fb":
            op = _operator(mod, work, local_dir, sink=_parquet_sink(out_dir))
            writer = stream.writeStream.foreachBatch(op.foreach_batch)
        elif variant == "tws":
            writer = (stream.groupBy("key")
                      .transformWithStateInPandas(mod._spark_processor(), OUTPUT, "Append",
                                                  "None")
                      .writeStream.format("parquet").option("path", str(out_dir)))
        elif variant == "count":
            writer = (stream.groupBy("key").count().writeStream.outputMode("update")
                      .foreachBatch(_parquet_sink(out_dir)))
        else:
            raise ValueError(f"unknown variant {variant!r}")
        q = (writer.option("checkpointLocation", str(work / "ck")).trigger(availableNow=True)
             .start())
        q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(f"{variant}: the query failed: {q.exception()}")
        progress = [json.loads(p.json) for p in q.recentProgress]
        last = int(progress[-1]["batchId"]) if progress else -1
        deadline = time.monotonic() + 10
        while cpu is not None and last not in cpu.at and time.monotonic() < deadline:
            time.sleep(0.05)  # the listener hears of the last batch on Spark's listener bus
        progress = [p for p in progress if p.get("numInputRows", 0) > 0]
        out: dict[str, Any] = {"t_query_start": t_query_start}
        if variant == "dstl" and progress:
            # the listener writes the last checkpoint shortly after Spark reports the batch
            out["checkpointed"] = op.wait_for_checkpoint(int(progress[-1]["batchId"]))
        if op is not None:
            out["dstl_stats"] = [{k: s.get(k) for k in (
                "batch_id", "batch_seconds", "job_seconds", "manifest_seconds",
                "restore_seconds", "rows_out", "accesses", "segments")}
                for s in op.batch_stats]
    finally:
        if op is not None:
            op.close()
        if cpu is not None:
            cpu.close()
    out["batches"] = []
    for p in sorted(progress, key=lambda p: int(p["batchId"])):
        b = int(p["batchId"])
        d = p.get("durationMs", {})
        out["batches"].append({
            "batch_id": b, "rows": int(p["numInputRows"]), "timestamp": p["timestamp"],
            "trigger_s": d.get("triggerExecution", 0) / 1e3,
            "add_batch_s": d.get("addBatch", 0) / 1e3,
            "cpu_s": (cpu.at[b] - cpu.at[b - 1] if cpu is not None and b in cpu.at
                      and b - 1 in cpu.at else None)})
    return out


def _ts(iso: str) -> float:
    """A progress report's ``timestamp`` (the trigger's start) as epoch seconds."""
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _batch_end(b: dict[str, Any]) -> float:
    return _ts(b["timestamp"]) + float(b["trigger_s"])


# ----------------------------------------------------------------- reading the outputs back


def output_rows(spark: Any, out: Path) -> Counter[tuple[str, int]]:
    return Counter((r["key"], int(r["count"])) for r in
                   spark.read.parquet(str(out)).select("key", "count").collect())


def output_summary(spark: Any, out: Path) -> dict[str, int]:
    """Rows, distinct keys and the smallest and largest count of an output (read by Spark,
    through the file sink's log where there is one)."""
    from pyspark.sql import functions as F

    r = (spark.read.parquet(str(out))
         .agg(F.count("*").alias("rows"), F.countDistinct("key").alias("keys"),
              F.min("count").alias("lo"), F.max("count").alias("hi")).collect()[0])
    return {k: int(r[k] or 0) for k in ("rows", "keys", "lo", "hi")}


# ----------------------------------------------------------------- RSS of the driver


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):  # the process ended meanwhile
        return 0
    return 0


def _jvm_pid(spark: Any) -> int:
    """The driver JVM (py4j's gateway process: spark-submit execs java)."""
    pid = int(spark.sparkContext._gateway.proc.pid)
    if Path(f"/proc/{pid}/comm").read_text().strip() == "java":
        return pid
    for d in Path("/proc").glob("[0-9]*"):  # a launcher that did not exec: its java child
        with contextlib.suppress(OSError, ValueError, IndexError):
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(f[1]) == pid and (d / "comm").read_text().strip() == "java":
                return int(d.name)
    return pid


class RssSampler:
    """RSS (kB) of groups of processes every ``interval_s`` on a daemon thread."""

    def __init__(self, groups: dict[str, Callable[[], list[int]]],
                 interval_s: float = RSS_INTERVAL_S) -> None:
        self.groups = groups
        self.samples: list[tuple[float, dict[str, int]]] = []
        self._stop = threading.Event()
        self._interval_s = interval_s
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            now = time.time()
            self.samples.append((now, {g: sum(_rss_kb(p) for p in pids())
                                       for g, pids in self.groups.items()}))
            if self._stop.wait(self._interval_s):
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def window(self, start: float, end: float, groups: tuple[str, ...]) -> dict[str, Any]:
        """Of the sum over ``groups``: the last sample before ``start``, the peak in
        ``[start, end]`` and their difference (MB)."""
        before = [s for t, s in self.samples if t < start]
        during = [s for t, s in self.samples if start <= t <= end]
        if not before or not during:
            return {"before_mb": None, "peak_mb": None, "delta_mb": None, "samples": len(during)}
        b = sum(before[-1][g] for g in groups) / 1024
        peak = max(sum(s[g] for g in groups) for s in during) / 1024
        return {"before_mb": b, "peak_mb": peak, "delta_mb": peak - b, "samples": len(during)}


# ----------------------------------------------------------------- child: the cluster figures


def child_steady(spark: Any, root: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Figure 1: every variant's query over the same files, repeats with the order rotated."""
    files = steady_files(cfg["batches"], cfg["rows"], cfg["keys"], seed=cfg["seed"])
    src = root / "steady-src"
    for i, f in enumerate(files):
        write_keys(src, i, f)
    model = running_count_model(files)
    variants = list(cfg["variants"])
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for rep in range(cfg["repeats"]):
        k = rep % len(variants)
        for v in variants[k:] + variants[:k]:
            work = root / f"steady-{v}-{rep}"
            shutil.rmtree(work, ignore_errors=True)  # an interrupted run's
            r = _query(spark, v, src, work, None, cpu_root=root)
            r["exact"] = output_rows(spark, work / "out") == model
            r["repeat"] = rep
            runs[v].append(r)
            print(f"steady {rep + 1}/{cfg['repeats']} {v}: " + ", ".join(
                f"{b['trigger_s']:.2f}s" for b in r["batches"]) + f" exact={r['exact']}",
                flush=True)
            shutil.rmtree(work, ignore_errors=True)
    return {"runs": runs, "model_rows": sum(model.values())}


def child_big(spark: Any, root: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Figure 2: per variant a query of a small batch, the TWS-size batch and (DSTL) the big
    batch; the driver's RSS around each."""
    from support.spark_cluster import executor_pids

    jvm = _jvm_pid(spark)
    me = os.getpid()
    deadline = time.monotonic() + 120
    while len(execs := sorted(executor_pids([root]))) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)  # executors register after the session starts; nothing to wait on
    sampler = RssSampler({"python": lambda: [me], "jvm": lambda: [jvm],
                          "executors": lambda: execs})
    out: dict[str, Any] = {"jvm_pid": jvm, "executor_pids": execs, "runs": {}}
    try:
        for v in cfg["variants"]:
            src, work = root / f"big-src-{v}", root / f"big-{v}"
            for x in (src, work):  # an interrupted run's
                shutil.rmtree(x, ignore_errors=True)
            sizes = [("warm", WARM_KEYS, "w"), ("same", cfg["same_keys"], "a")]
            if v != "tws":
                sizes.append(("big", cfg["big_keys"], "k"))
            for i, (_, n, prefix) in enumerate(sizes):
                write_keys(src, i, [f"{prefix}{j:08d}" for j in range(n)])
            r = _query(spark, v, src, work, None)
            for (label, n, _), b in zip(sizes, r["batches"], strict=False):
                b["label"], b["keys"] = label, n
                start, end = _ts(b["timestamp"]), _batch_end(b)
                b["driver_rss"] = sampler.window(start, end, ("python", "jvm"))
                b["python_rss"] = sampler.window(start, end, ("python",))
                b["jvm_rss"] = sampler.window(start, end, ("jvm",))
                b["executors_rss"] = sampler.window(start, end, ("executors",))
            total = sum(n for _, n, _ in sizes)
            got = output_summary(spark, work / "out")
            r["output"] = got
            r["exact"] = (got == {"rows": total, "keys": total, "lo": 1, "hi": 1}
                          and [b["keys"] for b in r["batches"]] == [n for _, n, _ in sizes])
            out["runs"][v] = r
            print(f"big {v}: " + ", ".join(
                f"{b['label']} {b['keys']:,} keys {b['trigger_s']:.2f}s driver "
                f"{(b['driver_rss']['delta_mb'] or 0):+.0f} MB" for b in r["batches"])
                + f" exact={r['exact']}", flush=True)
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(src, ignore_errors=True)
    finally:
        sampler.stop()
    return out


def child_cluster(root: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    from support.spark_cluster import drop_gateway, kill, processes_under

    res: dict[str, Any] = {"loadavg_before": os.getloadavg(), "other_jvms": other_jvms()}
    t0 = time.monotonic()
    spark = cluster_session(root)
    res["session_s"] = time.monotonic() - t0
    try:
        if cfg.get("steady"):
            res["steady"] = child_steady(spark, root, cfg["steady"])
        if cfg.get("big"):
            res["big"] = child_big(spark, root, cfg["big"])
    finally:
        spark.stop()
        drop_gateway()
        kill(processes_under([root]))
    res["loadavg_after"] = os.getloadavg()
    return res


# ----------------------------------------------------------------- child: the restart figure


def child_build(root: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Build each state of ``cfg["builds"]`` (``{name, variant, keys, dir}``) in one session."""
    spark = local_session(root, daemon=False)
    out: dict[str, Any] = {}
    try:
        for b in cfg["builds"]:
            d = Path(b["dir"])
            shutil.rmtree(d / "built", ignore_errors=True)  # an interrupted build's
            t0 = time.monotonic()
            r = _query(spark, b["variant"], d / "src", d / "built", d / "built" / "local")
            got = output_summary(spark, d / "built" / "out")
            r["exact"] = got == {"rows": b["keys"], "keys": b["keys"], "lo": 1, "hi": 1}
            r["wall_s"] = time.monotonic() - t0
            r["output"] = got
            out[b["name"]] = r
            shutil.rmtree(d / "built" / "local", ignore_errors=True)
            shutil.rmtree(d / "built" / "out", ignore_errors=True)
            print(f"build {b['name']}: {r['wall_s']:.0f}s, " + ", ".join(
                f"{x['trigger_s']:.1f}s" for x in r["batches"]) + f" exact={r['exact']}",
                flush=True)
            if not r["exact"]:
                raise RuntimeError(f"build {b['name']}: output {got}, expected {b['keys']} keys "
                                   "of count 1")
    finally:
        spark.stop()
    return {"builds": out}


def child_restart(root: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """One restart: a fresh session on a fresh copy of the built state; one batch."""
    d, run = Path(cfg["dir"]), Path(cfg["run"])
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    for name in ("ck", "state"):
        if (d / "built" / name).exists():
            shutil.copytree(d / "built" / name, run / name)
    # the copy is the bench's set-up, not the restart's: its dirty pages are written back now,
    # not during the next measured restart (of either engine)
    os.sync()
    res: dict[str, Any] = {"loadavg_before": os.getloadavg()}
    t0 = time.monotonic()
    spark = local_session(root, daemon=cfg["daemon"])
    res["session_s"] = time.monotonic() - t0
    try:
        # the file source reads the build's directory itself: its log names those files
        r = _query(spark, cfg["variant"], d / "src", run, run / "local")
        # the data files themselves: the sink's log of this new output path starts at the
        # restart batch's id, which Spark's reader of that log does not accept
        got = output_rows(spark, run / "out" / "part-*")
    finally:
        spark.stop()
    expected = Counter({(k, 2): 1 for k in cfg["restart_keys"]})
    res.update(r)
    res["exact"] = got == expected and len(r["batches"]) == 1
    b0 = r["batches"][0] if r["batches"] else None
    res["start_to_first_s"] = (_batch_end(b0) - r["t_query_start"]) if b0 else None
    res["loadavg_after"] = os.getloadavg()
    shutil.rmtree(run, ignore_errors=True)
    if not res["exact"]:
        raise RuntimeError(f"restart {cfg['variant']}: {len(r['batches'])} batches, "
                           f"{sum(got.values())} rows, expected {len(expected)} keys of "
                           f"count 2 ({sorted(got)[:5]} ...)")
    return res


def child_main(kind: str, args_path: Path, out_path: Path) -> int:
    cfg = json.loads(args_path.read_text())
    root = Path(cfg["root"])
    root.mkdir(parents=True, exist_ok=True)
    if kind == "cluster":
        res = child_cluster(root, cfg)
    elif kind == "build":
        res = child_build(root, cfg)
    else:
        res = child_restart(root, cfg)
    out_path.write_text(json.dumps(res, default=str))
    return 0


# ----------------------------------------------------------------- parent


#: the children whose results a resumed run took from the interrupted one
REUSED: list[str] = []


def run_child(kind: str, cfg: dict[str, Any], base: Path, label: str,
              timeout_s: float) -> dict[str, Any]:
    d = base / "children"
    d.mkdir(parents=True, exist_ok=True)
    args_path, out_path, log = d / f"{label}.args.json", d / f"{label}.json", d / f"{label}.log"
    if (out_path.exists() and args_path.exists()
            and json.loads(args_path.read_text()) == cfg):  # --resume: measured already
        print(f"  {label}: the result of an earlier, interrupted run of this command", flush=True)
        REUSED.append(label)
        kept: dict[str, Any] = json.loads(out_path.read_text())
        return kept
    out_path.unlink(missing_ok=True)
    args_path.write_text(json.dumps(cfg))
    cmd = [sys.executable, str(Path(__file__).absolute()), "--child", kind,
           "--child-args", str(args_path), "--child-out", str(out_path)]
    t0 = time.monotonic()
    with open(log, "w") as f:
        try:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                               check=False, cwd=ROOT)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(f"{label}: no result after {timeout_s:.0f}s; log {log}") from exc
    if r.returncode != 0:
        raise RuntimeError(f"{label} failed (exit {r.returncode}); log {log}:\n"
                           + log.read_text(errors="replace")[-4000:])
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(("steady ", "big ", "build ")):
            print(f"  {line}", flush=True)
    res: dict[str, Any] = json.loads(out_path.read_text())
    res["wall_s"] = time.monotonic() - t0
    out_path.write_text(json.dumps(res, default=str))
    return res


def _big_config(sizes: dict[str, Any], variants: list[str]) -> dict[str, Any]:
    return {"same_keys": sizes["tws_keys"], "big_keys": sizes["big_keys"],
            "variants": variants}


def figure_steady(base: Path, sizes: dict[str, Any], repeats: int, with_big: bool,
                  shape: str = "") -> dict[str, Any]:
    """Figure 1 in one cluster, at the small shape (``shape`` ``""``: ``batches`` x ``rows``
    over ``keys``) or the large one (``"large_"``: the ``large_*`` sizes); ``with_big``
    (quick mode) runs figure 2 after it in the same cluster."""
    cfg: dict[str, Any] = {
        "root": str(base / f"steady{shape.rstrip('_')}"),
        "steady": {"batches": sizes[f"{shape}batches"], "rows": sizes[f"{shape}rows"],
                   "keys": sizes[f"{shape}keys"], "seed": 41, "repeats": repeats,
                   "variants": list(STEADY_VARIANTS)}}
    if with_big:
        cfg["big"] = _big_config(sizes, list(BIG_VARIANTS))
    return run_child("cluster", cfg, base, f"steady{shape.rstrip('_')}", 3600)


def figure_big(base: Path, sizes: dict[str, Any], repeats: int) -> list[dict[str, Any]]:
    """Figure 2: one child (one driver) per variant and repeat."""
    out = []
    for rep in range(repeats):
        k = rep % len(BIG_VARIANTS)
        for v in BIG_VARIANTS[k:] + BIG_VARIANTS[:k]:
            cfg = {"root": str(base / f"big-{v}-{rep}"), "big": _big_config(sizes, [v])}
            res = run_child("cluster", cfg, base, f"big-{v}-{rep}", 3600)
            res["repeat"] = rep
            out.append(res)
            shutil.rmtree(base / f"big-{v}-{rep}", ignore_errors=True)
    return out


def restart_variants(sizes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> the build it restarts from, its engine variant and whether it uses DSTL's
    daemon (the same-size DSTL variant only when the sizes differ)."""
    n, m = sizes["restart_keys"], tws_restart_keys(sizes)
    out = {"dstl": {"build": "dstl-big", "variant": "dstl", "daemon": False, "keys": n},
           "dstl-daemon": {"build": "dstl-big", "variant": "dstl", "daemon": True, "keys": n},
           "tws": {"build": "tws", "variant": "tws", "daemon": False, "keys": m}}
    if n != m:
        out["dstl-same"] = {"build": "dstl-same", "variant": "dstl", "daemon": False, "keys": m}
    return out


def figure_restart(base: Path, sizes: dict[str, Any], repeats: int) -> dict[str, Any]:
    variants = restart_variants(sizes)
    builds = {v["build"]: {"name": v["build"], "variant": v["variant"], "keys": v["keys"],
                           "dir": str(base / "restart" / v["build"])}
              for v in variants.values()}
    touched: dict[str, list[str]] = {}
    for i, b in enumerate(builds.values()):
        src, n = Path(b["dir"]) / "src", b["keys"]
        per = min(n, BUILD_KEYS_PER_BATCH)
        files = -(-n // per)
        for f in range(files):
            write_keys(src, f, [f"k{j:08d}" for j in range(f * per, min(n, (f + 1) * per))])
        b["batches"] = files
        keys = sorted(f"k{j:08d}" for j in random.Random(13 + i).sample(
            range(n), sizes["touched"]))
        touched[b["name"]] = keys
    build = run_child("build", {"root": str(base / "restart" / "build-session"),
                                "builds": list(builds.values())}, base, "build",
                      max(7200.0, 0.01 * sum(b["keys"] for b in builds.values())))
    for b in builds.values():  # the restart batch: existing keys, each seen once before
        write_keys(Path(b["dir"]) / "src", b["batches"], touched[b["name"]])
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    names = list(variants)
    for rep in range(repeats):
        k = rep % len(names)
        for v in names[k:] + names[:k]:
            spec = variants[v]
            d = Path(builds[spec["build"]]["dir"])
            cfg = {"root": str(base / "restart" / f"session-{v}-{rep}"), "dir": str(d),
                   "run": str(d / f"run-{v}-{rep}"), "variant": spec["variant"],
                   "daemon": spec["daemon"], "restart_keys": touched[spec["build"]]}
            r = run_child("restart", cfg, base, f"restart-{v}-{rep}", 1800)
            r["repeat"] = rep
            runs[v].append(r)
            shutil.rmtree(base / "restart" / f"session-{v}-{rep}", ignore_errors=True)
            print(f"restart {rep + 1}/{repeats} {v}: query start to first batch done "
                  f"{r['start_to_first_s']:.2f}s (batch {r['batches'][0]['trigger_s']:.2f}s), "
                  f"load {r['loadavg_after'][0]:.1f}", flush=True)
    return {"variants": variants, "builds": build["builds"], "build_batches":
            {b["name"]: b["batches"] for b in builds.values()}, "runs": runs}


# ----------------------------------------------------------------- figures


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def steady_figures(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v, runs in res["steady"]["runs"].items():
        trig = [_med([b["trigger_s"] for b in r["batches"][1:]]) for r in runs]
        cpus = [[b["cpu_s"] for b in r["batches"][1:] if b["cpu_s"] is not None] for r in runs]
        # DSTL: partitions per batch that restored their state (moved to another executor)
        restores = [_med([sum(a == "restore" for a in s["accesses"])
                          for s in r["dstl_stats"][1:]]) for r in runs if r.get("dstl_stats")]
        out[v] = {"trigger_s": summary(trig),
                  "cpu_s": summary([_med(c) for c in cpus]) if all(cpus) else None,
                  "restores": summary(restores) if restores else None,
                  "first_trigger_s": summary([r["batches"][0]["trigger_s"] for r in runs]),
                  "batches": len(runs[0]["batches"]),
                  "exact": all(r["exact"] for r in runs)}
    for v in ("dstl", "dstl-fb"):  # same-repeat ratios to TWS
        ratios = [_med([b["trigger_s"] for b in a["batches"][1:]])
                  / _med([b["trigger_s"] for b in t["batches"][1:]])
                  for a, t in zip(res["steady"]["runs"][v], res["steady"]["runs"]["tws"],
                                  strict=True)]
        out[v]["ratio_to_tws"] = summary(ratios)
    return out


def big_figures(children: list[dict[str, Any]]) -> dict[str, Any]:
    per: dict[str, dict[str, list[dict[str, Any]]]] = {}
    exact: dict[str, bool] = {}
    for c in children:
        for v, r in c["big"]["runs"].items():
            exact[v] = exact.get(v, True) and r["exact"]
            for b in r["batches"]:
                per.setdefault(v, {}).setdefault(b["label"], []).append(b)
    out: dict[str, Any] = {}
    for v, labels in per.items():
        out[v] = {"exact": exact[v]}
        for label, bs in labels.items():
            if label == "warm":
                continue

            def s(key: str, sub: str | None = None, bs: list[dict[str, Any]] = bs
                  ) -> dict[str, float] | None:
                xs = [b[key][sub] if sub else b[key] for b in bs]
                xs = [x for x in xs if x is not None]
                return summary(xs) if xs else None

            out[v][label] = {"keys": bs[0]["keys"], "trigger_s": s("trigger_s"),
                             "driver_delta_mb": s("driver_rss", "delta_mb"),
                             "python_delta_mb": s("python_rss", "delta_mb"),
                             "jvm_delta_mb": s("jvm_rss", "delta_mb"),
                             "executors_delta_mb": s("executors_rss", "delta_mb"),
                             "driver_before_mb": s("driver_rss", "before_mb")}
    return out


def restart_figures(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    runs = res["runs"]
    for v, rs in runs.items():
        out[v] = {"keys": res["variants"][v]["keys"],
                  "start_to_first_s": summary([r["start_to_first_s"] for r in rs]),
                  "trigger_s": summary([r["batches"][0]["trigger_s"] for r in rs]),
                  "exact": all(r["exact"] for r in rs)}
        if v != "tws":  # per round, against TWS's restart of the same round
            out[v]["ratio_to_tws"] = summary([
                r["start_to_first_s"] / t["start_to_first_s"]
                for r, t in zip(rs, runs["tws"], strict=True)])
    out["builds"] = {name: {"wall_s": b["wall_s"], "batches": len(b["batches"]),
                            "trigger_s": [x["trigger_s"] for x in b["batches"]]}
                     for name, b in res["builds"].items()}
    return out


# ----------------------------------------------------------------- markdown


def _ms(s: dict[str, float] | None) -> str:
    return fmt(s, scale=1e3, digits=0) if s else "—"


def _s(s: dict[str, float] | None) -> str:
    return fmt(s, digits=2) if s else "—"


def _mb(s: dict[str, float] | None) -> str:
    return fmt(s, digits=0) if s else "—"


def _ratio(a: dict[str, float] | None, b: dict[str, float] | None) -> float | None:
    return a["median"] / b["median"] if a and b and b["median"] > 0 else None


def _goal(r: float | None, limit: float = 0.5) -> str:
    if r is None:
        return f"<= {limit}x: not measured"
    return f"<= {limit}x: {'met' if r <= limit else '**missed**'}"


def _x(r: float | None) -> str:
    return f"{r:.2f}x" if r is not None else "—"


#: bytes of one output row in Arrow: key "k%08d" (9 bytes + a 4-byte offset) + count (8 bytes)
ARROW_ROW_BYTES = 21


def markdown(figs: dict[str, Any], meta: dict[str, Any]) -> str:
    """The docs section: the headline figures against TWS and a short method; every other
    figure (CPU, ``foreach_batch``, first batches, builds, per-round ratios) is in the results
    file."""
    st, bg, rs = figs["steady"], figs["big"], figs["restart"]
    sz, q, rep = meta["sizes"], meta["quick"], meta["repeats"]
    n_tws, n_big, n_rst = sz["tws_keys"], sz["big_keys"], sz["restart_keys"]
    n_trs = tws_restart_keys(sz)
    d, t, c = st["dstl"], st["tws"], st["count"]
    r1 = _ratio(d["trigger_s"], t["trigger_s"])
    lines = ["| figure | DSTL | Spark TWS (same run) | ratio | goal |", "|---|---|---|---|---|",
             f"| steady batch, {sz['rows']:,} rows over {sz['keys']:,} keys (ms) | "
             f"{_ms(d['trigger_s'])} | {_ms(t['trigger_s'])} | {_x(r1)} | {_goal(r1)} |"]
    lg = figs.get("steady_large")
    if lg:
        r1l = _ratio(lg["dstl"]["trigger_s"], lg["tws"]["trigger_s"])
        lines.append(f"| steady batch, {sz['large_rows']:,} rows over {sz['large_keys']:,} "
                     f"keys (ms) | {_ms(lg['dstl']['trigger_s'])} | "
                     f"{_ms(lg['tws']['trigger_s'])} | {_x(r1l)} | {_goal(r1l)} |")
    lines.append(f"| context: Spark's JVM-only `groupBy().count()` (ms) | — | "
                 f"{_ms(c['trigger_s'])} | DSTL / count "
                 f"{_x(_ratio(d['trigger_s'], c['trigger_s']))} | — |")
    bd, bt = bg.get("dstl", {}), bg.get("tws", {})
    same_d, same_t, big_d = bd.get("same"), bt.get("same"), bd.get("big")
    r2 = _ratio(same_d and same_d["trigger_s"], same_t and same_t["trigger_s"])
    out_mb = n_big * ARROW_ROW_BYTES / 1e6
    flat = (f"flat (< {out_mb:.1f} MB): "
            f"{'met' if big_d['driver_delta_mb']['median'] < out_mb else '**missed**'}"
            if big_d and big_d.get("driver_delta_mb") else "not measured")
    lines += [f"| batch of {n_tws:,} output rows (s) | {_s(same_d and same_d['trigger_s'])} | "
              f"{_s(same_t and same_t['trigger_s'])} | {_x(r2)} | {_goal(r2)} |",
              f"| batch of {n_big:,} output rows: driver RSS growth (MB) | "
              f"{_mb(big_d and big_d['driver_delta_mb'])} | not run | — | {flat} |"]
    bl = rs.get("builds", {})
    bd_, bt_ = bl.get("dstl-big"), bl.get("tws")
    if bd_ and bt_ and n_trs == n_rst:  # both built the same keys in the same batches
        per = min(n_rst, BUILD_KEYS_PER_BATCH)
        d_b, t_b = summary(bd_["trigger_s"]), summary(bt_["trigger_s"])
        rb = _ratio(d_b, t_b)
        lines.append(f"| batch of {per:,} new keys = {per:,} output rows, `local[2]` (the "
                     f"restart state's build, {len(bd_['trigger_s'])} batches) (s) | "
                     f"{_s(d_b)} | {_s(t_b)} | {_x(rb)} | {_goal(rb)} |")
    rd, rt, rdd = rs["dstl"], rs["tws"], rs["dstl-daemon"]
    r3 = _ratio(rd["start_to_first_s"], rt["start_to_first_s"])
    at = f"{n_rst:,} keys" + (f" (TWS at {n_trs:,})" if n_trs != n_rst else ", both")
    lines += [f"| restart at {at}, query start to first batch "
              f"done (s) | {_s(rd['start_to_first_s'])} | {_s(rt['start_to_first_s'])} | "
              f"{_x(r3)} | {_goal(r3)} |",
              f"| the same with `spark.python.daemon.module=dstl.spark.daemon` (s) | "
              f"{_s(rdd['start_to_first_s'])} | {_s(rt['start_to_first_s'])} | "
              f"{_x(_ratio(rdd['start_to_first_s'], rt['start_to_first_s']))} | — |"]
    rsame = rs.get("dstl-same")
    if rsame:
        r3s = _ratio(rsame["start_to_first_s"], rt["start_to_first_s"])
        lines.append(f"| restart, both at {n_trs:,} keys (s) | {_s(rsame['start_to_first_s'])} "
                     f"| {_s(rt['start_to_first_s'])} | {_x(r3s)} | {_goal(r3s)} |")
    exact = all(f[v]["exact"] for f in (st, lg or {}, bg, rs) for v in f
                if isinstance(f[v], dict) and "exact" in f[v])
    origin = (f"Steady and output-row figures from the run at "
              f"{meta['figures_1_2_from']['commit']} (its load in its results file); "
              "restarts: " if meta.get("figures_1_2_from") else "")
    lines += [
        "",
        f"Median (min..max) of {rep['steady']} repeats ({rep['big']} for the output-row "
        f"batches); {'quick mode, not meaningful; ' if q else ''}a running count per key on "
        f"both engines (DSTL: `op.transform`, LMDB + agent, {PARTITIONS} partitions; Spark: "
        "`transformWithStateInPandas` on RocksDB with changelog checkpointing) into the "
        "Parquet sink. Steady batches on `local-cluster[2,1,1024]`, restarts in `local[2]` "
        "(a new process, an empty executor-local directory, no warm-up). TWS was not run at "
        f"{n_big:,} output rows" + (f" or built at {n_rst:,} keys" if n_trs < n_rst else "")
        + ": one state round trip per key makes that take about 42 min per million keys. "
        "Outputs checked against an independent computation: "
        f"{'all exact' if exact else '**not all exact**'}. {origin}{meta['load_note']}."]
    return "\n".join(lines)


# ----------------------------------------------------------------- main


def tws_restart_keys(sizes: dict[str, Any]) -> int:
    """The keys of TWS's state in figure 3 (``tws_keys`` unless set apart)."""
    return int(sizes.get("tws_restart_keys") or sizes["tws_keys"])


def sizes_for(args: argparse.Namespace) -> dict[str, Any]:
    q = args.quick
    return {"batches": args.batches or (3 if q else 10),
            "rows": args.rows or (500 if q else 3000),
            "keys": args.keys or (100 if q else 500),
            "tws_keys": args.tws_keys or (2_000 if q else 50_000),
            "big_keys": args.big_keys or (20_000 if q else 1_000_000),
            "restart_keys": args.restart_keys or (2_000 if q else 1_000_000),
            "tws_restart_keys": args.tws_restart_keys,
            "touched": 500 if q else 2_000,
            # figure 1 again at thousands of keys per batch (per-key costs, not fixed ones)
            "large_batches": args.large_batches or (3 if q else 6),
            "large_rows": args.large_rows or (2_000 if q else 20_000),
            "large_keys": args.large_keys or (1_000 if q else 10_000)}


def command_line(args: argparse.Namespace) -> str:
    parts = [".venv/bin/python bench/in_query.py"]
    if args.quick:
        parts.append("--quick")
    if args.restart_from:
        parts.append(f"--restart-from {args.restart_from}")
    for flag in ("repeats", "big_repeats", "batches", "rows", "keys", "large_batches",
                 "large_rows", "large_keys", "tws_keys", "big_keys", "restart_keys",
                 "tws_restart_keys"):
        v = getattr(args, flag)
        if v is not None and not (flag == "repeats" and v == 5):
            parts.append(f"--{flag.replace('_', '-')} {v}")
    return " ".join(parts)


def dirty_files() -> list[str]:
    r = subprocess.run(["git", "status", "--porcelain", "--", "dstl", "materializer", "restore"],
                       cwd=ROOT, capture_output=True, text=True, check=False)
    return [line[3:] for line in r.stdout.splitlines() if line.strip()]


def results_of(raw: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    figs = {"steady": steady_figures(raw["steady"]),
            "steady_large": steady_figures(raw["steady_large"]) if "steady_large" in raw
            else None,  # a run stored before the large shape existed
            "big": big_figures(raw["big"]),
            "restart": restart_figures(raw["restart"])}
    return {"figures": figs, "meta": meta, "raw": raw}


def publish(results: dict[str, Any], args: argparse.Namespace,
            machine: dict[str, Any] | None = None) -> None:
    md = markdown(results["figures"], results["meta"])
    write_results(NAME, results, md, quick=results["meta"]["quick"],
                  command=results["meta"]["command"], no_doc=args.no_doc, tag=args.tag,
                  machine=machine)
    print(md)


def main() -> int:
    p = parser(__doc__.split("\n", 1)[0])
    p.add_argument("--big-repeats", type=int, default=None,
                   help="repeats of figure 2 (default 3: each is a new cluster per variant, "
                        "TWS's batch alone takes several minutes)")
    p.add_argument("--batches", type=int, default=None, help="steady: batches per query")
    p.add_argument("--rows", type=int, default=None, help="steady: rows per batch")
    p.add_argument("--keys", type=int, default=None, help="steady: distinct keys")
    p.add_argument("--large-batches", type=int, default=None,
                   help="steady, large shape: batches per query")
    p.add_argument("--large-rows", type=int, default=None,
                   help="steady, large shape: rows per batch")
    p.add_argument("--large-keys", type=int, default=None,
                   help="steady, large shape: distinct keys")
    p.add_argument("--tws-keys", type=int, default=None,
                   help="the batch size both engines run in figure 2 and TWS's restart state")
    p.add_argument("--big-keys", type=int, default=None, help="figure 2: DSTL's big batch")
    p.add_argument("--restart-keys", type=int, default=None, help="figure 3: DSTL's state")
    p.add_argument("--tws-restart-keys", type=int, default=None,
                   help="figure 3: TWS's state (default: --tws-keys; building TWS's state "
                        "takes about 2.5 ms per key)")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="the work directory of an interrupted run of the same command: take "
                        "the results it has, measure the rest")
    p.add_argument("--restart-from", default=None, metavar="JSON",
                   help="measure figure 3 only and take figures 1 and 2 from a stored run "
                        "(its results file; the docs name both commits)")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="rewrite the docs section from a stored run, measuring nothing")
    p.add_argument("--child", choices=("cluster", "build", "restart"), help=argparse.SUPPRESS)
    p.add_argument("--child-args", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child_main(args.child, Path(args.child_args), Path(args.child_out))
    if args.render:
        doc = json.loads(Path(args.render).read_text())
        run = doc.get("figures", doc)  # a results file, or the raw measurements a run kept
        publish(results_of(run["raw"], run["meta"]), args, machine=doc.get("machine"))
        return 0
    q = args.quick
    repeats = 1 if q and "--repeats" not in sys.argv else args.repeats
    big_repeats = args.big_repeats or (1 if q else min(3, repeats))
    sizes = sizes_for(args)
    t0 = time.monotonic()
    load = LoadSampler()
    jvms = other_jvms()
    dirty = dirty_files()
    if args.resume:
        base = Path(args.resume)
    else:
        base = Path(tempfile.mkdtemp(prefix="dstl-bench-in-query-"))
        print(f"work directory {base}; if the run is interrupted, the same command with "
              f"--resume {base} measures only what is missing", flush=True)
    raw: dict[str, Any] = {}
    earlier: dict[str, Any] | None = None
    if args.restart_from:
        earlier = json.loads(Path(args.restart_from).read_text())
        kept_raw = earlier["figures"]["raw"]
        raw.update({k: kept_raw[k] for k in ("steady", "steady_large", "big") if k in kept_raw})
        sizes = earlier["figures"]["meta"]["sizes"] | {
            k: getattr(args, k) for k in ("restart_keys", "tws_restart_keys")
            if getattr(args, k) is not None}
    try:
        if earlier is None:
            raw["steady"] = figure_steady(base, sizes, repeats, with_big=q)
            raw["steady_large"] = figure_steady(base, sizes, repeats, False, shape="large_")
            raw["big"] = [raw["steady"]] if q else figure_big(base, sizes, big_repeats)
        raw["restart"] = figure_restart(base, sizes, repeats)
    except BaseException:
        print(f"failed; the measurements so far stay in {base} (--resume {base})", flush=True)
        raise
    shutil.rmtree(base, ignore_errors=True)
    load.stop()
    meta = {"quick": q, "sizes": sizes, "command": command_line(args), "dirty": dirty,
            "reused": REUSED,
            "repeats": {"steady": repeats, "big": big_repeats, "restart": repeats},
            "load": load.summary, "load_note": load.note(), "other_jvms": jvms,
            "total_s": time.monotonic() - t0}
    if earlier is not None:
        em = earlier["figures"]["meta"]
        meta["repeats"].update(steady=em["repeats"]["steady"], big=em["repeats"]["big"])
        meta["figures_1_2_from"] = {"commit": earlier.get("machine", {}).get("git_sha"),
                                    "measured": earlier.get("machine", {}).get("time"),
                                    "load_note": em["load_note"],
                                    "total_s": em["total_s"]}
    # kept apart first: a run of an hour is not lost to an error in the figures
    kept = base.with_name(base.name + "-raw.json")
    kept.write_text(json.dumps({"raw": raw, "meta": meta}, default=str))
    print(f"raw measurements in {kept} (--render {kept} recomputes the figures)", flush=True)
    results = results_of(raw, meta)
    figs = results["figures"]
    publish(results, args)
    kept.unlink()
    exact = [figs["steady"][v]["exact"] for v in figs["steady"]] + \
        [f["exact"] for f in figs["big"].values()] + \
        [f["exact"] for k, f in figs["restart"].items() if k != "builds"]
    if not all(exact):
        print("an output differs from the independent computation", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
