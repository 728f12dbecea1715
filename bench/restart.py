"""Restart benchmark: the first micro-batch after a restart, DSTL vs Spark's RocksDB
state store with changelog checkpointing, by state size, with and without snapshots.

The job (reference ``measured_next.md``): count per key, keys ``k%08d``, each key written once
over B build batches (text file source, ``maxFilesPerTrigger=1``, ``availableNow``; 200 k keys
per batch up to 1 M keys, 500 k beyond, 50 k in ``--quick``), ``local[2]``, 4 partitions. Then
the query stops, and a fresh SparkSession processes 2 small batches of 2,000 existing keys each;
the figure is ``triggerExecution`` of the first of them (the restart batch). Every restart key
must come out with count 2 (DSTL: the processor checks it; Spark: the sink), so a lost state
fails the run instead of looking fast.

Variants:

* ``dstl-lmdb`` / ``dstl-lmdb-snap`` — ``DstlStatefulOperator`` with LMDB tables and the executor
  agent (the defaults); ``-snap``: ``materialization_interval_s=1`` (the agent materializes every
  partition about every second, plus the size trigger); without: no timer, no size trigger, so
  the restart replays the whole log.
* ``dstl-heap`` / ``dstl-heap-snap`` — the same with heap tables (the agent still uploads and
  owns the restore cache; the task materializes synchronously when due).
* ``spark`` / ``spark-snap`` — ``groupBy("key").count()`` in update mode on
  ``RocksDBStateStoreProvider`` with ``changelogCheckpointing.enabled``; ``-snap``:
  ``minDeltasForSnapshot=1``, ``maintenanceInterval=1s`` (without: the defaults, 10 and 60 s, so
  no snapshot exists after B <= 9 batches). The sink collects the batch to the driver
  (``toArrow``), as the DSTL operator does with its outputs.

How it runs: each variant's state is built once per size (the build phase, in a child process);
after the build, Spark-snapshot variants wait until every partition's newest version is uploaded
as a snapshot (``<B>.zip``), so Spark restores from a snapshot of the last batch. Each repeat then
runs a new child process that restarts from a fresh copy of the built Spark checkpoint and DSTL
store (the "cold process" figure: new driver JVM), stops, and restarts from a second fresh copy
in a new SparkSession of the same process (the main figure, a "fresh SparkSession":
warm driver JVM; new SparkContext, executor, Python workers and, for DSTL, agent, with an empty
executor-local directory, so all state comes from the store, as after losing the executor);
restarts of all variants are interleaved per repeat, order rotated. Per restart: the batch's
``triggerExecution``/``addBatch``; the state load — DSTL: ``restore_seconds`` of the slowest task
(``op.batch_stats``), and per task from a bench-only hook in the workers (wraps
``dstl.spark.slots.restore_backend`` to keep its ``RestoreStats``: snapshot-load and replay
seconds, entries, changes, GC pause time; and wraps ``_runtime`` to time each task's start, its
worker's and the Python daemon's process start and the agent start-up, which is where a Python
job's first batch goes); Spark: the RocksDB load metrics of the state operator;
bytes downloaded and objects read — DSTL: the agent's restore-cache counters; Spark: from the
checkpoint (the snapshot zip and the SST files its metadata lists, plus the changelogs after it).
From the build: steady batch times, materializations (LMDB: the agent's log lines; heap: the
hook around ``materialize_now``), the snapshot and log-tail bytes the restart starts from.

Run: ``.venv/bin/python bench/restart.py [--quick] [--keys 1000000,4000000] [--repeats 5]
[--repeats-large 3]``. Quick: 200 k keys, 1 repeat, about 10 min on 2 cores. Full (1 M and 4 M
keys, 5 restart repeats of every variant, ``--repeats-large`` at 4 M; each variant's state is
built once per size): 3-4 h on 2 cores.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    LoadSampler,
    add_render,
    fmt,
    other_jvms,
    parser,
    render_stored,
    summary,
    table,
)
from bench._common import publish as publish_results  # noqa: E402
from dstl.spark.processor import StatefulProcessor, StatefulProcessorHandle  # noqa: E402

PARTITIONS = 4
MAX_PARALLELISM = 128
RESTART_KEYS = 2_000  # keys per restart batch
RESTART_BATCHES = 2
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
HOOK_ENV = "DSTL_BENCH_RESTART_HOOK"
#: Spark state files: N.changelog / N.zip (N = batch id + 1; checkpoint v2 adds _<uuid>)
_SPARK_FILE = re.compile(r"^(\d+)(?:_[^.]+)?\.(changelog|zip)$")
_AGENT_MAT = re.compile(r"materialized \S+ \((\S+), checkpoint (\d+)\) from outside its writer: "
                        r"(\d+) entries, (\d+) bytes to \S+ in ([\d.]+) ms")


@dataclass(frozen=True)
class Variant:
    name: str
    engine: str  # "dstl" | "spark"
    table: str  # "lmdb" | "heap" | "rocksdb"
    snapshots: bool
    warm: bool = False  # DSTL: op.warm_up(spark) before the query starts
    daemon: bool = False  # DSTL: spark.python.daemon.module=dstl.spark.daemon
    tasks: int | None = None  # DSTL: the operator's tasks (None: one wave over the slots)

    @property
    def label(self) -> str:
        what = {"lmdb": "DSTL LMDB + agent", "heap": "DSTL heap", "rocksdb": "Spark RocksDB"}
        return (f"{what[self.table]}, {'snapshots' if self.snapshots else 'log only'}"
                + (", warm-up" if self.warm else "") + (", DSTL daemon" if self.daemon else "")
                + (", one task per partition" if self.tasks == PARTITIONS else ""))

    @property
    def build_name(self) -> str:
        """The variant whose built state this one restarts from (a warm-up, daemon or
        task-per-partition variant shares its twin's build)."""
        return self.name.removesuffix("-pertask").removesuffix("-daemon").removesuffix("-warm")


VARIANTS = {v.name: v for v in (
    Variant("dstl-lmdb", "dstl", "lmdb", False), Variant("dstl-lmdb-snap", "dstl", "lmdb", True),
    Variant("dstl-heap", "dstl", "heap", False), Variant("dstl-heap-snap", "dstl", "heap", True),
    Variant("spark", "spark", "rocksdb", False), Variant("spark-snap", "spark", "rocksdb", True),
    Variant("dstl-lmdb-warm", "dstl", "lmdb", False, True),
    Variant("dstl-lmdb-snap-warm", "dstl", "lmdb", True, True),
    Variant("dstl-heap-snap-warm", "dstl", "heap", True, True),
    Variant("dstl-lmdb-daemon", "dstl", "lmdb", False, daemon=True),
    Variant("dstl-lmdb-snap-daemon", "dstl", "lmdb", True, daemon=True),
    Variant("dstl-heap-snap-daemon", "dstl", "heap", True, daemon=True),
    Variant("dstl-lmdb-warm-daemon", "dstl", "lmdb", False, True, True),
    Variant("dstl-lmdb-snap-warm-daemon", "dstl", "lmdb", True, True, True),
    # one task per partition (two waves of tasks on local[2]): what `tasks=None` saves
    Variant("dstl-lmdb-snap-warm-daemon-pertask", "dstl", "lmdb", True, True, True, PARTITIONS))}


def spark_twin(v: Variant) -> Variant:
    return VARIANTS["spark-snap" if v.snapshots else "spark"]


# ----------------------------------------------------------------- the job


class Count(StatefulProcessor):
    """DSTL: rows per key (one value state)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.count = handle.get_value_state("count")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        c = (self.count.get() or 0) + sum(1 for _ in rows)
        self.count.update(c)
        yield {"key": key, "count": c}


class RestartCount(Count):
    """After the restart every key is an existing key seen once before: its count must be 2
    (checked here, at no cost to the timed batch, instead of in a sink)."""

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        for out in super().handle_input_rows(key, rows):
            if out["count"] != 2:
                raise RuntimeError(f"key {key!r} counted {out['count']} after the restart, "
                                   "expected 2: the restored state is wrong")
            yield out


def batch_keys(n: int, quick: bool) -> int:
    return 50_000 if quick else (200_000 if n <= 1_000_000 else 500_000)


def write_lines(path: Path, keys: list[str]) -> None:
    tmp = path.with_name("." + path.name + ".tmp")  # hidden: the file source skips it
    tmp.write_text("".join(k + "\n" for k in keys))
    os.replace(tmp, path)


def write_build_files(src: Path, n: int, per_batch: int) -> int:
    src.mkdir(parents=True, exist_ok=True)
    b = math.ceil(n / per_batch)
    for i in range(b):
        write_lines(src / f"part-{i:05d}.txt",
                    [f"k{j:08d}" for j in range(i * per_batch, min(n, (i + 1) * per_batch))])
    return b


def write_restart_files(src: Path, n: int, first: int, seed: int) -> None:
    keys = [f"k{j:08d}" for j in random.Random(seed).sample(range(n), RESTART_KEYS *
                                                            RESTART_BATCHES)]
    for i in range(RESTART_BATCHES):
        write_lines(src / f"part-{first + i:05d}.txt",
                    keys[i * RESTART_KEYS:(i + 1) * RESTART_KEYS])


# ----------------------------------------------------------------- bench-only worker hook


def _record(kind: str, **fields: Any) -> None:
    d = os.environ.get(HOOK_ENV)
    if d:
        with open(os.path.join(d, f"{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"kind": kind, "pid": os.getpid(), "t": time.time(),
                                **fields}) + "\n")


class _GcClock:
    """Wall time spent in cyclic GC while armed (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.armed = False
        self.seconds = 0.0
        self.collections = [0, 0, 0]
        self._t = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase: str, info: dict[str, Any]) -> None:
        if not self.armed:
            return
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.collections[info["generation"]] += 1

    def arm(self) -> None:
        self.armed, self.seconds, self.collections = True, 0.0, [0, 0, 0]


def _proc_start(pid: int) -> float | None:
    """A process's start time (epoch seconds, 10 ms resolution) from /proc."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


_IMPORTED_AT = time.time()


def _install_worker_hook() -> None:
    """In a Spark Python worker (``HOOK_ENV`` set): record every restore and heap
    materialization of the task code, with its figures. Measurement only; behaviour unchanged."""
    if not os.environ.get(HOOK_ENV):
        return
    import dstl.spark.runtime as runtime_mod
    import dstl.spark.slots as slots_mod
    import dstl.spark.task as task_mod
    from materializer.backend import ChangelogKeyedStateBackend

    if getattr(slots_mod.restore_backend, "_bench_hook", False):
        return
    real_restore, real_runtime = slots_mod.restore_backend, task_mod.runtime_for
    real_mat = ChangelogKeyedStateBackend.materialize_now
    clock = _GcClock()

    def restore_backend(*args: Any, **kw: Any) -> Any:
        stats = kw.get("stats")
        clock.arm()
        t0 = time.perf_counter()
        try:
            return real_restore(*args, **kw)
        finally:
            clock.armed = False
            _record("restore", operator_id=kw.get("operator_id"), table=kw.get("table"),
                    seconds=time.perf_counter() - t0, gc_seconds=clock.seconds,
                    gc_collections=clock.collections, **dict(stats or {}))

    def runtime(cfg: Any) -> Any:
        new = (cfg.state_uri, cfg.name) not in runtime_mod._RUNTIMES
        started, t0 = time.time(), time.perf_counter()
        rt = real_runtime(cfg)
        _record("task", operator=cfg.name, runtime_seconds=time.perf_counter() - t0,
                new_runtime=new, started=started, imported_at=_IMPORTED_AT,
                worker_start=_proc_start(os.getpid()), daemon_start=_proc_start(os.getppid()))
        return rt

    def materialize_now(self: Any, timeout_s: float | None = None) -> Any:
        t0 = time.perf_counter()
        ref = real_mat(self, timeout_s)
        if ref is not None:
            _record("materialize", operator_id=self.operator_id,
                    seconds=time.perf_counter() - t0, bytes=ref.size)
        return ref

    restore_backend._bench_hook = True  # type: ignore[attr-defined]
    slots_mod.restore_backend = restore_backend
    task_mod.runtime_for = runtime
    ChangelogKeyedStateBackend.materialize_now = materialize_now  # type: ignore[method-assign]


_install_worker_hook()


def read_hook(d: Path) -> list[dict[str, Any]]:
    out = []
    for p in sorted(d.glob("*.jsonl")):
        out += [json.loads(line) for line in p.read_text().splitlines() if line]
    return sorted(out, key=lambda r: r["t"])


# ----------------------------------------------------------------- one session (child process)


def session(v: Variant, spark_local: Path) -> Any:
    from pyspark.sql import SparkSession

    # workers run this interpreter and import this module by reference (the processor classes)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    b = (SparkSession.builder.master("local[2]").appName(f"bench-restart-{v.name}")
         .config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.driver.memory", "2g")
         .config("spark.local.dir", str(spark_local))  # the executor dir: the agent lives there
         .config("spark.sql.shuffle.partitions", str(PARTITIONS))
         .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
         .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true"))
    if v.daemon:  # workers forked with DSTL, pyarrow and pandas imported (dstl.spark.daemon)
        b = b.config("spark.python.daemon.module", "dstl.spark.daemon")
    if v.engine == "spark" and v.snapshots:
        b = (b.config("spark.sql.streaming.stateStore.minDeltasForSnapshot", "1")
             .config("spark.sql.streaming.stateStore.maintenanceInterval", "1s"))
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def dstl_operator(v: Variant, mod: Any, state: Path, local_dir: Path, restart: bool) -> Any:
    from dstl.spark import DstlStatefulOperator
    from materializer import BackendOptions

    if v.snapshots:  # the defaults: size trigger on (ratio 2), 1 s interval
        opts, interval = BackendOptions(), 1.0
    else:  # no timer, no size trigger: the restart replays the whole log
        opts, interval = BackendOptions(materialization_interval_s=None,
                                        materialize_log_ratio=None), None
    return DstlStatefulOperator(
        name="count", processor=mod.RestartCount if restart else mod.Count, key_column="key",
        output_schema="key string, count long", state_uri=str(state), partitions=PARTITIONS,
        max_parallelism=MAX_PARALLELISM, table=v.table, local_dir=str(local_dir), agent=True,
        backend_options=opts, materialization_interval_s=interval, tasks=v.tasks)


def spark_sink(restart: bool) -> Callable[[Any, int], None]:
    import pyarrow.compute as pc

    def sink(df: Any, batch_id: int) -> None:
        t = df.toArrow()  # the outputs to the driver, as the DSTL operator does with its own
        if restart and not (t.num_rows == RESTART_KEYS and pc.all(pc.equal(t["count"], 2)).as_py()):
            raise RuntimeError(f"batch {batch_id}: {t.num_rows} rows, counts "
                               f"{sorted(set(t['count'].to_pylist()))[:5]} after the restart, "
                               f"expected {RESTART_KEYS} rows of count 2")
    return sink


def run_query(spark: Any, v: Variant, d: Path, src: Path, restart: bool) -> dict[str, Any]:
    """Process every file not yet processed (``availableNow``); progress and DSTL stats."""
    mod: Any = importlib.import_module("bench.restart")
    stream = (spark.readStream.option("maxFilesPerTrigger", 1).text(str(src))
              .withColumnRenamed("value", "key"))
    op: Any = None
    if v.engine == "spark":
        writer = (stream.groupBy("key").count().writeStream.outputMode("update")
                  .foreachBatch(spark_sink(restart)))
    else:
        op = dstl_operator(v, mod, d / "state", d / "local", restart)
        op.validate(spark)
        writer = stream.writeStream.foreachBatch(op.foreach_batch)
    out: dict[str, Any] = {}
    try:
        # the honest clock: from here (before the warm-up, if any) to the first batch's end
        out["t_query_start"] = time.time()
        if op is not None and v.warm and restart:
            out["warm_up"] = op.warm_up(spark)
            if "error" in out["warm_up"]:
                raise RuntimeError(f"{v.name}: the warm-up failed: {out['warm_up']['error']}")
        q = writer.option("checkpointLocation", str(d / "ck")).trigger(availableNow=True).start()
        q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(f"{v.name}: the query failed: {q.exception()}")
        out["progress"] = [p for p in (json.loads(x.json) for x in q.recentProgress)
                           if p.get("numInputRows", 0) > 0]
        if op is not None:
            out["batch_stats"] = list(op.batch_stats)
            out["manifest"] = manifest_sizes(op.coordinator.latest())
    finally:
        if op is not None:
            op.close()
    return out


def manifest_sizes(m: Any) -> dict[str, Any]:
    """What a restore from this checkpoint reads: snapshot and log-tail bytes per partition."""
    from materializer import ChangelogStateBackendHandle

    parts = {}
    for t in m.tasks:
        h = ChangelogStateBackendHandle.from_json(json.dumps(dict(t.state)))
        parts[t.task_id] = {"snapshot_bytes": h.materialized_size,
                            "log_bytes": h.non_materialized_size,
                            "snapshots": len(h.materialized),
                            "change_sets": sum(len(n) for n in h.non_materialized)}
    return {"checkpoint_id": m.checkpoint_id, "partitions": parts,
            "snapshot_bytes": sum(p["snapshot_bytes"] for p in parts.values()),
            "log_bytes": sum(p["log_bytes"] for p in parts.values())}


def batch_row(p: dict[str, Any]) -> dict[str, Any]:
    d = p.get("durationMs", {})
    row: dict[str, Any] = {"batch_id": int(p["batchId"]), "rows": p["numInputRows"],
                           "timestamp": p.get("timestamp"),
                           "trigger_s": d.get("triggerExecution", 0) / 1e3,
                           "add_batch_s": d.get("addBatch", 0) / 1e3,
                           "duration_ms": d}
    ops = p.get("stateOperators") or []
    if ops:
        row["state_rows_total"] = sum(o.get("numRowsTotal", 0) for o in ops)
        row["state_commit_s"] = sum(o.get("commitTimeMs", 0) for o in ops) / 1e3
        row["state_updates_s"] = sum(o.get("allUpdatesTimeMs", 0) for o in ops) / 1e3
        row["custom_metrics"] = ops[0].get("customMetrics", {})
    return row


# ----------------------------------------------------------------- what each engine left behind


def spark_versions(ck: Path) -> dict[str, dict[str, dict[int, Path]]]:
    """Per state partition directory: ``{"zip": {version: path}, "changelog": {...}}``."""
    out: dict[str, dict[str, dict[int, Path]]] = {}
    root = ck / "state" / "0"
    for pdir in sorted(root.iterdir()) if root.exists() else []:
        if not pdir.is_dir() or not pdir.name.isdigit():
            continue
        kinds: dict[str, dict[int, Path]] = {"zip": {}, "changelog": {}}
        for f in pdir.iterdir():
            m = _SPARK_FILE.match(f.name)
            if m:
                kinds[m.group(2)][int(m.group(1))] = f
        out[pdir.name] = kinds
    return out


def wait_spark_snapshots(ck: Path, version: int, timeout_s: float) -> float:
    """Wait until every partition's ``version`` is uploaded as a snapshot; seconds waited."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        vs = spark_versions(ck)
        if len(vs) == PARTITIONS and all(version in k["zip"] for k in vs.values()):
            return time.monotonic() - t0
        time.sleep(0.2)  # another process (the maintenance thread) uploads; nothing to wait on
    raise RuntimeError(f"Spark did not upload snapshot version {version} of every partition "
                       f"within {timeout_s:.0f}s: {spark_versions(ck)}")


def spark_restore_reads(ck: Path, version: int) -> dict[str, Any]:
    """The objects a restore of ``version`` reads: the newest snapshot zip <= version, the SSTs
    its metadata lists, and the changelogs after it."""
    objects = nbytes = changelogs = 0
    snapshot_versions = []
    for kinds in spark_versions(ck).values():
        zips = [z for z in kinds["zip"] if z <= version]
        base = max(zips, default=0)
        if base:
            z = kinds["zip"][base]
            objects += 1
            nbytes += z.stat().st_size
            for sst in _zip_ssts(z):
                objects += 1
                nbytes += int(sst.get("sizeBytes", 0))
        snapshot_versions.append(base)
        logs = [p for c, p in kinds["changelog"].items() if base < c <= version]
        changelogs += len(logs)
        objects += len(logs)
        nbytes += sum(p.stat().st_size for p in logs)
    return {"objects": objects, "bytes": nbytes, "changelogs": changelogs,
            "snapshot_versions": snapshot_versions}


def _zip_ssts(z: Path) -> list[dict[str, Any]]:
    with zipfile.ZipFile(z) as zf:
        text = zf.read("metadata").decode()
    body = text.split("\n", 1)[1] if text.startswith("v") else text
    return list(json.loads(body).get("sstFiles", []))


def agent_dirs(spark_local: Path) -> list[Path]:
    return sorted(spark_local.glob("**/dstl-agent"))


def agent_materializations(spark_local: Path) -> list[dict[str, float]]:
    """The agent's materializations, from its log (one line per partition run)."""
    out = []
    for d in agent_dirs(spark_local):
        log = d / "agent.log"
        for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
            m = _AGENT_MAT.search(line)
            if m:
                out.append({"operator_id": m.group(1), "checkpoint_id": int(m.group(2)),
                            "entries": int(m.group(3)), "bytes": int(m.group(4)),
                            "seconds": float(m.group(5)) / 1e3})
    return out


def stop_agents(spark_local: Path) -> dict[str, float]:
    """Shut the executor agent(s) down (after reading their metrics)."""
    from bench.agent import agent_metrics_and_stop
    from dstl.spark.agent import AgentClient, socket_path

    out: dict[str, float] = {}
    for d in agent_dirs(spark_local):
        sock = socket_path(str(d))
        try:
            client = AgentClient(sock)
        except OSError:
            continue  # not running (any more)
        try:
            pid = int(client.metrics().get("agent.pid", -1))
        finally:
            client.close()
        out.update(agent_metrics_and_stop(sock, pid))
    return out


def one_session(spark_local: Path, v: Variant, d: Path, src: Path, batches: int,
                restart: bool) -> dict[str, Any]:
    """One SparkSession on the state in ``d``: process every new file, then stop."""
    out: dict[str, Any] = {"variant": v.name, "restart": restart,
                           "loadavg_before": os.getloadavg(), "t_start": time.time()}
    t0 = time.monotonic()
    spark = session(v, spark_local)
    out["session_s"] = time.monotonic() - t0
    try:
        t1 = time.monotonic()
        q = run_query(spark, v, d, src, restart)
        out["query_s"] = time.monotonic() - t1
        out["t_query_start"] = q["t_query_start"]
        out["warm_up"] = q.get("warm_up")
        out["batches"] = [batch_row(p) for p in q["progress"]]
        out["batch_stats"] = q.get("batch_stats", [])
        out["manifest"] = q.get("manifest")
        if v.engine == "spark" and v.snapshots and not restart:
            out["snapshot_wait_s"] = wait_spark_snapshots(d / "ck", batches, 600.0)
        if v.engine == "spark":
            if not restart:  # what a restart from this checkpoint will read
                out["restore_reads"] = spark_restore_reads(d / "ck", batches)
        else:  # before stop(): the agent's directory goes with the executor's
            out["agent_materializations"] = agent_materializations(spark_local)
            out["agent_metrics"] = stop_agents(spark_local)
    finally:
        spark.stop()
        shutil.rmtree(d / "local", ignore_errors=True)
    out["t_end"] = time.time()
    out["loadavg_after"] = os.getloadavg()
    out["other_jvms"] = other_jvms()
    expected = batches if not restart else RESTART_BATCHES
    if len(out["batches"]) != expected:
        raise RuntimeError(f"{v.name}: {len(out['batches'])} batches, expected {expected}")
    return out


def child(mode: str, v: Variant, d: Path, src: Path, batches: int) -> dict[str, Any]:
    """This (child) process: ``build`` the state in ``d``; or ``restart``: from ``d/cold`` in
    the new process (cold driver JVM), then, after stopping that session, from ``d/warm`` in a
    fresh SparkSession of the same process."""
    hook = d / "hook"
    hook.mkdir(parents=True, exist_ok=True)
    os.environ[HOOK_ENV] = str(hook)  # inherited by the JVM, so by its Python workers
    spark_local = Path(tempfile.mkdtemp(prefix="dsr-", dir="/tmp"))  # one per JVM (cached)
    try:
        if mode == "build":
            runs = {"build": one_session(spark_local, v, d, src, batches, False)}
        else:
            runs = {"cold": one_session(spark_local, v, d / "cold", src, batches, True),
                    "warm": one_session(spark_local, v, d / "warm", src, batches, True)}
    finally:
        shutil.rmtree(spark_local, ignore_errors=True)
    records = read_hook(hook)
    for r in runs.values():  # one JVM, so one hook directory: split the records by time
        r["hook"] = [h for h in records if r["t_start"] <= h["t"] <= r["t_end"]]
    return runs


# ----------------------------------------------------------------- orchestration (parent)


def run_child(mode: str, v: Variant, d: Path, src: Path, batches: int,
              timeout_s: float) -> dict[str, Any]:
    d.mkdir(parents=True, exist_ok=True)
    out, log = d / f"{mode}-result.json", d.parent / f"{d.name}-{mode}.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--variant", v.name,
           "--dir", str(d), "--src", str(src), "--batches", str(batches), "--out", str(out)]
    t0 = time.monotonic()
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s,
                           check=False, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"{v.name} {mode} failed (exit {r.returncode}); log {log}:\n"
                           + log.read_text(errors="replace")[-4000:])
    res: dict[str, Any] = json.loads(out.read_text())
    res["wall_s"] = time.monotonic() - t0
    return res


def copy_state(build: Path, run: Path) -> None:
    """Pristine copies of the built Spark checkpoint and DSTL store, one per restart."""
    shutil.rmtree(run, ignore_errors=True)
    for sub in ("cold", "warm"):
        (run / sub).mkdir(parents=True)
        for name in ("ck", "state"):
            if (build / name).exists():
                shutil.copytree(build / name, run / sub / name)


def run_size(base: Path, n: int, variants: list[Variant], repeats: int, quick: bool,
             seed: int) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """Build every variant's state at ``n`` keys, then restart each ``repeats`` times."""
    src = base / "src"
    per = batch_keys(n, quick)
    b = write_build_files(src, n, per)
    timeout = 600 + n / 1_000  # s; 4 M keys: ~1.3 h at worst
    builds: dict[str, Any] = {}
    for v in dict.fromkeys(VARIANTS[x.build_name] for x in variants):
        t = time.monotonic()
        res = run_child("build", v, base / v.name / "build", src, b, timeout)
        builds[v.name] = {**res["build"], "wall_s": res["wall_s"]}
        steady = [x["trigger_s"] for x in builds[v.name]["batches"][1:]]
        print(f"[{n:,}] build {v.name}: {time.monotonic() - t:.0f}s, {b} batches, steady "
              f"{statistics.median(steady) if steady else float('nan'):.2f}s", flush=True)
    write_restart_files(src, n, b, seed)
    restarts: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    for rep in range(repeats):
        k = rep % len(variants)
        for v in variants[k:] + variants[:k]:
            run = base / v.name / f"run{rep}"
            copy_state(base / v.build_name / "build", run)
            r = run_child("restart", v, run, src, b, timeout)
            r["repeat"] = rep
            restarts[v.name].append(r)
            shutil.rmtree(run, ignore_errors=True)
            print(f"[{n:,}] restart {rep + 1}/{repeats} {v.name}: first batch "
                  f"{r['warm']['batches'][0]['trigger_s']:.2f}s (cold process "
                  f"{r['cold']['batches'][0]['trigger_s']:.2f}s), load "
                  f"{r['warm']['loadavg_after'][0]:.1f}", flush=True)
    for name in builds:
        shutil.rmtree(base / name / "build", ignore_errors=True)
    return {"keys": n, "batches": b, "keys_per_batch": per, "builds": builds}, restarts


# ----------------------------------------------------------------- figures


def _ts(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def _first(records: list[dict[str, Any]], field: str, start: float) -> float | None:
    xs = [r[field] for r in records if r.get(field) is not None]
    return min(xs) - start if xs else None


def restart_figures(v: Variant, r: dict[str, Any]) -> dict[str, Any]:
    """One restart's figures (the first batch after it)."""
    b0 = r["batches"][0]
    f: dict[str, Any] = {"trigger_s": b0["trigger_s"], "add_batch_s": b0["add_batch_s"],
                         "second_trigger_s": r["batches"][1]["trigger_s"],
                         "session_s": r["session_s"], "load_1m": r["loadavg_after"][0]}
    start = _ts(b0["timestamp"])
    end = start + b0["trigger_s"] + 0.5
    if r.get("t_query_start") is not None:  # older results have no query start
        f["start_to_first_s"] = start + b0["trigger_s"] - r["t_query_start"]
    f["warm_up_s"] = (r.get("warm_up") or {}).get("seconds", 0.0)
    if v.engine == "spark":
        cm = b0.get("custom_metrics", {})
        f["custom_metrics"] = cm
        f["load_s"] = float(cm.get("rocksdbLoadLatencyMs", 0)) / 1e3
        f["updates_s"] = b0.get("state_updates_s")
        f["commit_s"] = b0.get("state_commit_s")
        f["bytes_copied"] = float(cm.get("rocksdbBytesCopied", 0))
        f["files_copied"] = float(cm.get("rocksdbFilesCopied", 0))
        return f
    bs = r["batch_stats"][0]
    agent = next(iter(bs.get("agents", {}).values()), {})
    # the batch's own restores and tasks (a warm-up's ran before the batch started)
    restores = [h for h in r["hook"] if h["kind"] == "restore" and start <= h["t"] <= end]
    tasks = [h for h in r["hook"] if h["kind"] == "task" and start <= h["t"] <= end]
    f.update({
        "load_s": bs["restore_seconds"], "restore_total_s": bs["restore_seconds_total"],
        "accesses": bs["accesses"], "restores": len(restores),
        "snapshot_s": sum(h.get("snapshot_seconds", 0.0) for h in restores),
        "replay_s": sum(h.get("replay_seconds", 0.0) for h in restores),
        "entries": sum(int(h.get("entries", 0)) for h in restores),
        "changes": sum(int(h.get("changes", 0)) for h in restores),
        "gc_s": sum(h.get("gc_seconds", 0.0) for h in restores),
        "bytes_downloaded": agent.get("agent.cache.bytes_downloaded", float("nan")),
        "objects_read": agent.get("agent.cache.downloads", float("nan")),
        "job_s": bs["job_seconds"], "manifest_s": bs["manifest_seconds"],
        "first_task_after_s": (min(t["started"] for t in tasks) - start) if tasks else None,
        "daemon_start_after_s": _first(tasks, "daemon_start", start),
        "worker_start_after_s": _first(tasks, "worker_start", start),
        "worker_imported_after_s": _first(tasks, "imported_at", start),
        "runtime_init_s": max((t["runtime_seconds"] for t in tasks if t["new_runtime"]),
                              default=0.0)})
    return f


def build_figures(v: Variant, bld: dict[str, Any]) -> dict[str, Any]:
    """What the build left for the restart, and what materializing cost while it ran."""
    steady = [b["trigger_s"] for b in bld["batches"][1:]] or [bld["batches"][0]["trigger_s"]]
    f: dict[str, Any] = {"wall_s": bld["wall_s"], "steady_trigger_s": summary(steady),
                         "first_trigger_s": bld["batches"][0]["trigger_s"],
                         "load_1m": [bld["loadavg_before"][0], bld["loadavg_after"][0]],
                         "other_jvms": bld["other_jvms"]}
    if v.engine == "spark":
        f["restore_reads"] = bld["restore_reads"]
        f["snapshot_wait_s"] = bld.get("snapshot_wait_s")
        return f
    if v.table == "lmdb":
        mats = bld["agent_materializations"]
    else:
        mats = [h for h in bld["hook"] if h["kind"] == "materialize"]
    last: dict[str, dict[str, Any]] = {}
    for m in mats:  # in time order: the last one per partition is the largest
        last[m["operator_id"]] = m
    m_ = bld["manifest"]
    f.update({
        "materializations": len(mats),
        "last_round_s": sum(m["seconds"] for m in last.values()),
        "last_round_bytes": sum(m["bytes"] for m in last.values()),
        "last_round_partitions": len(last),
        "last_round_s_max": max((m["seconds"] for m in last.values()), default=0.0),
        "snapshot_bytes": m_["snapshot_bytes"], "tail_bytes": m_["log_bytes"],
        "checkpoint_id": m_["checkpoint_id"],
        "build_restores": sum(1 for h in bld["hook"] if h["kind"] == "restore"),
        "build_restore_s": sum(h["seconds"] for h in bld["hook"] if h["kind"] == "restore")})
    return f


_SUMMED = ("trigger_s", "add_batch_s", "second_trigger_s", "session_s", "load_s",
           "cold_trigger_s", "cold_load_s",
           "restore_total_s", "snapshot_s", "replay_s", "entries", "changes", "gc_s",
           "bytes_downloaded", "objects_read", "job_s", "first_task_after_s", "runtime_init_s",
           "daemon_start_after_s", "worker_start_after_s", "worker_imported_after_s",
           "updates_s", "commit_s", "bytes_copied", "files_copied",
           "manifest_s", "start_to_first_s", "warm_up_s")


def size_figures(meta: dict[str, Any], restarts: dict[str, list[dict[str, Any]]]
                 ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, runs in restarts.items():
        v = VARIANTS[name]
        per = [{**restart_figures(v, r["warm"]),
                "cold_trigger_s": r["cold"]["batches"][0]["trigger_s"],
                "cold_load_s": restart_figures(v, r["cold"])["load_s"]} for r in runs]
        f: dict[str, Any] = {k: summary([float(p[k]) for p in per]) for k in _SUMMED
                             if per and all(p.get(k) is not None for p in per)
                             and k in per[0]}
        f["runs"] = per
        f["build"] = build_figures(v, meta["builds"][v.build_name])
        out[name] = f
    for name, f in out.items():  # DSTL / Spark, per repeat (the same interleaved round)
        twin = spark_twin(VARIANTS[name]).name
        if VARIANTS[name].engine == "dstl" and twin in out:
            for key, phase in (("ratio", "warm"), ("cold_ratio", "cold")):
                mine = {r["repeat"]: r[phase]["batches"][0]["trigger_s"] for r in restarts[name]}
                theirs = {r["repeat"]: r[phase]["batches"][0]["trigger_s"]
                          for r in restarts[twin]}
                f[key] = summary([mine[k] / theirs[k] for k in mine if k in theirs])
            mine_s = {p["repeat"]: p.get("start_to_first_s") for p in _with_repeat(
                f["runs"], restarts[name])}
            theirs_s = {p["repeat"]: p.get("start_to_first_s") for p in _with_repeat(
                out[twin]["runs"], restarts[twin])}
            xs = [mine_s[k] / theirs_s[k] for k in mine_s
                  if mine_s[k] and theirs_s.get(k)]
            if xs:
                f["start_ratio"] = summary(xs)
    return out


def _with_repeat(per: list[dict[str, Any]], runs: list[dict[str, Any]]
                 ) -> list[dict[str, Any]]:
    return [{**p, "repeat": r["repeat"]} for p, r in zip(per, runs)]


# ----------------------------------------------------------------- report


def _c(s: dict[str, float] | None, scale: float = 1.0, digits: int = 2) -> str:
    return fmt(s, scale=scale, digits=digits) if s else "-"


def _mb(x: float | None) -> str:
    return "-" if x is None or x != x else f"{x / 1e6:,.1f}"


def load_note(raw: dict[int, Any], info0: dict[str, Any]) -> tuple[str, bool]:
    """How busy the machine was: 1-min load average around every child run, other JVMs."""
    runs = [r for x in raw.values() for r in [
        *x["meta"]["builds"].values(),
        *(y[phase] for ys in x["restarts"].values() for y in ys for phase in ("cold", "warm"))]]
    loads = [r["loadavg_before"][0] for r in runs] + [r["loadavg_after"][0] for r in runs]
    jvms = max([info0["other_jvms"], *(r["other_jvms"] for r in runs)])
    cores = os.cpu_count() or 1
    # a Spark job alone keeps about 2 runnable threads on 2 cores; more means a neighbour
    noisy = jvms > 0 or max(loads) > cores + 1
    sampled = info0.get("load", {})
    text = (f"Load average (1 min) around the {len(runs)} child runs: median "
            f"{statistics.median(loads):.1f}, max {max(loads):.1f} (sampled every 5 s over the "
            f"whole run: median {sampled.get('median', float('nan')):.1f}, max "
            f"{sampled.get('max', float('nan')):.1f}) on {cores} cores; other JVMs "
            f"seen: {jvms}" + (" — **noisy: other jobs shared the machine; absolute times are "
                               "pessimistic, the DSTL/Spark ratios are from interleaved runs**"
                               if noisy else " — quiet"))
    return text, noisy


def markdown(results: dict[str, Any]) -> str:
    """The docs section of a run, from its stored results: per size and variant the restart
    batch and the time from the query's start (DSTL with a warm-up: from the warm-up's start)
    to the first batch done, each with its same-round ratio to Spark's."""
    figs, raw = _int_keys(results["figures"]), _int_keys(results["raw"])
    reps = _int_keys(results["repeats"])
    rows = []
    for n, per in sorted(figs.items()):
        for name, f in per.items():
            v = VARIANTS[name]
            r = f.get("ratio")
            goal = ("-" if not r else "<= 0.5x: "
                    + ("met" if r["median"] <= 0.5 else "**missed**"))
            rows.append([f"{n:,}", v.label, _c(f["trigger_s"]),
                         f"**{_c(r)}x**" if r else "-", _c(f.get("start_to_first_s")),
                         f"{_c(f.get('start_ratio'))}x" if f.get("start_ratio") else "-", goal])
    _, noisy = load_note(raw, results["machine_start"])
    sizes = ", ".join(f"{reps[n]} at {n:,} keys" for n in sorted(figs))
    md = [table(["keys", "variant", "restart batch s", "DSTL / Spark (same round)",
                 "query start to first batch done s", "DSTL / Spark", "goal"], rows), ""]
    if not results["quick"]:
        md += ["Restart time vs keys: ![restart time vs keys](img/restart_keys.png)", ""]
    md.append(
        f"Count per key, `local[2]`, 4 partitions; a fresh SparkSession with an empty local "
        f"directory processes {RESTART_KEYS:,} existing keys; restart batch = its "
        f"`triggerExecution`. Median (min..max) over {sizes}; ratio = median of the per-round "
        "ratios" + ("; noisy" if noisy else "") + ".")
    if results.get("failed"):
        md += ["", *(f"**Failed at {n:,} keys** (not in the table): `{e}`"
                     for n, e in _int_keys(results["failed"]).items())]
    return "\n".join(md)


def plot(figs: dict[int, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = {"lmdb": "o-", "heap": "^-", "rocksdb": "s--", "lmdb-warm": "o:",
              "heap-warm": "^:", "lmdb-daemon": "D-", "heap-daemon": "v-",
              "lmdb-warm-daemon": "D:", "heap-warm-daemon": "v:"}
    for name, v in VARIANTS.items():
        xs = sorted(n for n, per in figs.items() if name in per)
        if not xs:
            continue
        ss = [figs[n][name]["trigger_s"] for n in xs]
        med = [s["median"] for s in ss]
        ax.errorbar(xs, med, yerr=[[m - s["min"] for m, s in zip(med, ss)],
                                   [s["max"] - m for m, s in zip(med, ss)]],
                    fmt=styles[v.table + ("-warm" if v.warm else "") + ("-daemon" if v.daemon else "")], mfc="none" if not v.snapshots else None, capsize=3,
                    label=v.label)
    ax.set_xscale("log")
    ax.set_xlabel("keys in the state (count per key, 4 partitions)")
    ax.set_ylabel("first batch after restart, triggerExecution (s)")
    ax.set_title("Restart time vs state size: DSTL vs Spark RocksDB + changelog")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this run (``--tag`` is added by ``write_results``)."""
    parts = [".venv/bin/python bench/restart.py"]
    if args.quick:
        parts.append("--quick")
    for flag, value, default in (("--keys", args.keys, None), ("--repeats", args.repeats, 5),
                                 ("--repeats-large", args.repeats_large, None),
                                 ("--variants", args.variants, ",".join(VARIANTS))):
        if value is not None and value != default:
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def main() -> int:
    p = parser(__doc__.split("\n", 1)[0])
    p.add_argument("--keys", default=None,
                   help="state sizes, comma-separated (default 1000000,4000000; quick 200000)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--repeats-large", type=int, default=None,
                   help="restart repeats for sizes above 1 M keys (default: --repeats; at 4 M "
                        "keys each round of 6 variants takes about 15 min on 2 cores)")
    add_render(p)
    p.add_argument("--child", choices=("build", "restart"), help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--batches", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        res = child(args.child, VARIANTS[args.variant], Path(args.dir), Path(args.src),
                    args.batches)
        Path(args.out).write_text(json.dumps(res, default=str))
        return 0
    if args.render:
        return render_stored("restart", Path(args.render), markdown)
    q = args.quick
    sizes = [int(x) for x in (args.keys or ("200000" if q else "1000000,4000000")).split(",")]
    repeats = 1 if q and "--repeats" not in sys.argv else args.repeats
    variants = [VARIANTS[x] for x in args.variants.split(",") if x]
    t0 = time.monotonic()
    load = LoadSampler()
    info0 = {"loadavg": os.getloadavg(), "other_jvms": other_jvms()}
    base = Path(tempfile.mkdtemp(prefix="dstl-bench-restart-"))
    raw: dict[int, Any] = {}
    figs: dict[int, dict[str, Any]] = {}
    reps = {n: args.repeats_large if n > 1_000_000 and args.repeats_large else repeats
            for n in sizes}
    failed: dict[int, str] = {}
    try:
        for n in sizes:
            try:
                meta, restarts = run_size(base / f"n{n}", n, variants, reps[n], q, seed=13)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                # the sizes measured so far are still reported; this one is named as failed
                failed[n] = f"{type(exc).__name__}: {exc}"[-1500:]
                print(f"[{n:,}] FAILED: {failed[n]}", flush=True)
                continue
            raw[n] = {"meta": meta, "restarts": restarts}
            figs[n] = size_figures(meta, restarts)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if not figs:
        print("every size failed; nothing written", flush=True)
        return 1
    info0["load"] = load.stop()
    results = {"sizes": sizes, "failed": failed, "repeats": reps, "figures": figs, "raw": raw,
               "total_s": time.monotonic() - t0, "machine_start": info0, "quick": q,
               "command": command_line(args)}
    publish(results, args.tag, args.no_doc)
    return 1 if failed else 0


def _int_keys(d: dict[str, Any]) -> dict[int, Any]:
    return {int(k): v for k, v in d.items()}


def publish(results: dict[str, Any], tag: str | None, no_doc: bool) -> None:
    """JSON, plot and docs section of a run."""
    if not no_doc and not results["quick"]:
        plot(results["figures"], ROOT / "docs" / "img" / "restart_keys.png")
    publish_results("restart", results, markdown, quick=results["quick"],
                    command=results["command"], no_doc=no_doc, tag=tag)


if __name__ == "__main__":
    sys.exit(main())
