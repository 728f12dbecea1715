"""State size: what a steady micro-batch writes, stores and costs, and what a restart waits
for, as the state grows — DSTL (LMDB tables, the executor agent) vs Spark's RocksDB state store
with changelog checkpointing, same workload, same run.

Workload: N keys (``k%09d``), each a 256-byte value (128 hex digits of two SHA-256 digests and
128 constant bytes: zstd compresses it ~3.5x), written once in the build batches (at most
``--build-chunk`` keys per batch), then ``--batches`` steady batches each updating
``--update`` of the keys at random, ``trigger(processingTime=--pace-s)``, ``local[2]``, 4
partitions. The rows are made in the query from small JSON files (a key range or a list of key
ids per file, ``maxFilesPerTrigger=1``), so the source costs both variants the same.

Variants (``--variants``):

* ``dstl`` — ``DstlStatefulOperator`` (``op.transform``, ``noop`` sink), LMDB tables, the
  executor agent, ``materialization_interval_s=10``, ``incremental_snapshots=True`` (the agent
  writes deltas, ``dstl.spark.agent.materializer``); the processor keeps the row's value in a
  value state;
* ``dstl-full`` — the same with ``incremental_snapshots=False`` (every materialization uploads the
  whole table), at the smallest size only (it shows what the deltas save; the run's time goes to
  the larger sizes);
* ``spark`` — Spark's native streaming aggregation ``groupBy(key).agg(max(value))`` (update
  mode, ``noop`` sink) on ``RocksDBStateStoreProvider`` with changelog checkpointing: a 256-byte
  value per key in the same store a ``transformWithStateInPandas`` job uses, without the Python
  round trip (its build at 1 M keys and beyond takes too long for this run).

Each variant runs in a child process (fresh driver JVM): build, steady batches; after every
batch the driver lists the state location (DSTL: the ``state_uri``; Spark: the checkpoint's
``state/``) and reads the CPU seconds of its whole process tree (driver, JVM, Python workers,
the agent). Figures per steady batch (one batch = one ``--pace-s`` interval): ``triggerExecution``
(median, min..max over the steady batches), CPU, store bytes and objects written (files that
appeared; a file written and deleted between two listings is missed, none lives that short),
local disk after the steady batches (DSTL: its ``local_dir``; Spark: its RocksDB working
directories under ``spark.local.dir``), peak anonymous RSS of the child's process tree (sampled
by the parent every 0.5 s; and at that peak, each kind of process: the JVM, the Python
workers, the agent, the driver's Python). Restart: a new child process (new driver JVM, empty
executor-local directories) runs one more steady batch on the same checkpoint and store:
seconds from the process start to that batch done, from the query's ``start()`` to it, and
its ``triggerExecution``.

One run per variant and size (the steady figures are medians over the steady batches; a restart
is one sample); sizes above 4 M keys only with ``--large`` (16 M).

Run: ``flock /tmp/dstl-bench.lock .venv/bin/python bench/scale.py [--quick]
[--keys 200000,1000000,4000000] [--large]``.
"""

from __future__ import annotations

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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    LoadSampler,
    parser,
    summary,
    tree_cpu_s,
    write_results,
)
from dstl.spark import StatefulProcessor  # noqa: E402

VARIANTS = ("dstl", "dstl-full", "spark")
PARTITIONS = 4
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
INTERVAL_S = 10.0


class KeepValue(StatefulProcessor):
    """The newest value of each key, in a value state; no output rows."""

    def init(self, handle: Any) -> None:
        self.value = handle.get_value_state("value")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        last = None
        for r in rows:
            last = r["value"]
        self.value.update(last)
        return iter(())


# ----------------------------------------------------------------- the child: one query


def _session(name: str, local_dir: Path) -> Any:
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    spark = (SparkSession.builder.master("local[2]").appName(name)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "2g")
             .config("spark.local.dir", str(local_dir))
             .config("spark.sql.shuffle.partitions", str(PARTITIONS))
             .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
             .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
                     "true")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _rows(spark: Any, src: Path) -> Any:
    from pyspark.sql import functions as F

    stream = (spark.readStream.schema("lo long, hi long, ids array<long>, b long")
              .option("maxFilesPerTrigger", 1).json(str(src)))
    ids = F.when(F.col("ids").isNull(), F.sequence("lo", F.col("hi") - 1)).otherwise(F.col("ids"))
    rows = stream.select(F.explode(ids).alias("id"), "b")
    salt = F.concat_ws(":", F.col("id").cast("string"), F.col("b").cast("string"))
    return rows.select(
        F.format_string("k%09d", "id").alias("key"),
        F.concat(F.sha2(F.concat(salt, F.lit("a")), 256), F.sha2(F.concat(salt, F.lit("b")), 256),
                 F.lit("x" * 128)).alias("value"))


def _list(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            try:
                out[p] = os.path.getsize(p)
            except OSError:
                continue
    return out


def _du(path: Path, only: str | None = None) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        if only is not None and only not in root.lower():
            continue
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                continue
    return total


def _snapshots(new: dict[str, int]) -> list[tuple[int, str]]:
    """DSTL's new snapshot objects: ``(bytes, "delta" | "full")`` each (format byte 5)."""
    out = []
    for path, size in sorted(new.items()):
        if os.sep + "snapshots" + os.sep not in path:
            continue
        try:
            with open(path, "rb") as f:
                version = f.read(8)[5:6]
        except OSError:
            continue  # deleted meanwhile
        out.append((size, "delta" if version == b"\x03" else "full"))
    return out


def _kinds_of(new: dict[str, int]) -> dict[str, int]:
    """Bytes of the new files by kind: DSTL ``log`` (segments), ``snapshot`` (full and delta
    objects), ``checkpoint`` (manifests); Spark ``changelog`` (``*.changelog``), ``snapshot``
    (``*.zip``, ``*.sst``: RocksDB snapshot uploads), ``other``."""
    out: dict[str, int] = {}
    for path, size in new.items():
        parts = path.split(os.sep)
        if "dstl" in parts:
            kind = "log"
        elif "snapshots" in parts or path.endswith((".zip", ".sst")):
            kind = "snapshot"
        elif path.endswith(".changelog"):
            kind = "changelog"
        elif "checkpoints" in parts:
            kind = "checkpoint"
        else:
            kind = "other"
        out[kind] = out.get(kind, 0) + size
    return out


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One query in this process: ``cfg["batches"]`` batches (all its files are in the source),
    then stop. Per batch: trigger time, tree CPU and the state location's new files."""
    t_start = time.time()
    variant, work = cfg["variant"], Path(cfg["work"])
    # the processor by its module's name (workers import it; __main__ is this process's only)
    mod: Any = importlib.import_module("bench.scale")
    local = work / f"local-{cfg['phase']}"
    spark = _session(f"scale-{variant}-{cfg['phase']}", local / "spark")
    rows = _rows(spark, work / "src")
    op = None
    if variant == "spark":
        from pyspark.sql import functions as F

        out = rows.groupBy("key").agg(F.max("value").alias("v"))
        writer = out.writeStream.outputMode("update")
        watched = work / "ck" / "state"
    else:
        from dstl.spark import DstlStatefulOperator
        from materializer import BackendOptions

        op = DstlStatefulOperator(
            name="scale", processor=mod.KeepValue, key_column="key", output_schema="key string",
            state_uri=str(work / "state"), partitions=PARTITIONS, max_parallelism=128,
            table="lmdb", local_dir=str(local / "dstl"), materialization_interval_s=INTERVAL_S,
            backend_options=BackendOptions(incremental_snapshots=variant == "dstl"))
        writer = op.transform(rows).writeStream
        watched = work / "state"
    seen = _list(watched)
    batches: list[dict[str, Any]] = []
    t_query = time.time()
    q = (writer.format("noop").option("checkpointLocation", str(work / "ck"))
         .trigger(processingTime=f"{cfg['pace_s']} seconds").start())
    done = -1
    try:
        while len(batches) < cfg["batches"]:
            if q.exception() is not None:
                raise RuntimeError(f"{variant}: {q.exception()}")
            p = q.lastProgress
            if p is None or int(p["batchId"]) == done or p.get("numInputRows", 0) == 0:
                time.sleep(0.05)
                continue
            done = int(p["batchId"])
            now = _list(watched)
            new = {k: v for k, v in now.items() if k not in seen}
            seen = now
            batches.append({"batch_id": done, "done_at": time.time(),
                            "trigger_s": p["durationMs"].get("triggerExecution", 0) / 1e3,
                            "rows": int(p.get("numInputRows", 0)), "cpu_s": tree_cpu_s(),
                            "new_bytes": sum(new.values()), "new_objects": len(new),
                            "snapshots": _snapshots(new), "kinds": _kinds_of(new),
                            "durations_ms": p["durationMs"],
                            "state_operators": p.get("stateOperators")
                            if cfg["phase"] == "restart" else None})
        disk = (_du(local / "dstl") if variant != "spark"
                else _du(local / "spark", only="statestore"))
        disk_all = _du(local)
        # DSTL's own account of its batches (restore seconds per task, the agents' cache and
        # materializer counters): where a restart's first batch goes
        dstl_stats = [{k: v for k, v in st.items() if k != "tasks"}
                      for st in (op.batch_stats[-3:] if op is not None else [])]
    finally:
        q.stop()
        if op is not None:
            op.close()
        spark.stop()
    return {"batches": batches, "t_start": t_start, "t_query": t_query,
            "local_disk_bytes": disk, "local_all_bytes": disk_all, "dstl_stats": dstl_stats,
            "store_bytes": sum(_list(watched).values()), "store_objects": len(_list(watched))}


# ----------------------------------------------------------------- the parent


def _tree(pid: int) -> list[int]:
    parent: dict[int, int] = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            parent[int(d.name)] = int(f[1])
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
    out, frontier = [pid], [pid]
    while frontier:
        nxt = [c for c, pp in parent.items() if pp in frontier]
        out += nxt
        frontier = nxt
    return out


def _anon_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        return 0  # ended meanwhile
    return 0


def _kind(pid: int) -> str:
    """The kind of a process of a child's tree, from its command line."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "other"  # ended meanwhile
    if os.path.basename(argv[0]) == b"java":
        return "JVM"
    if b"dstl.spark.agent" in argv:
        return "agent"
    if b"pyspark.daemon" in argv or b"pyspark.worker" in argv:
        return "python workers"
    return "driver (Python)" if b"--child" in argv else "other"


def run_child(cfg: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`child` in a new process; its result plus the tree's peak anonymous RSS (and
    that of each kind of process at that moment) and the process start time."""
    out = Path(cfg["work"]) / f"result-{cfg['phase']}.json"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(cfg), str(out)],
                            cwd=str(ROOT))
    peak, at_peak = 0, {}
    while proc.poll() is None:
        kinds: dict[str, int] = {}
        for p in _tree(proc.pid):
            kb = _anon_kb(p)
            if kb:
                kinds[_kind(p)] = kinds.get(_kind(p), 0) + kb
        if sum(kinds.values()) > peak:
            peak, at_peak = sum(kinds.values()), kinds
        time.sleep(0.5)
    if proc.returncode != 0:
        raise RuntimeError(f"{cfg['variant']} {cfg['phase']} failed ({proc.returncode})")
    r: dict[str, Any] = json.loads(out.read_text())
    r["t_process"] = t0
    r["peak_anon_mb"] = peak / 1024
    r["peak_anon_by_kind_mb"] = {k: v / 1024 for k, v in sorted(at_peak.items())}
    return r


def _write(src: Path, i: int, obj: dict[str, Any]) -> None:
    tmp = src / f".f{i:05d}.json"
    tmp.write_text(json.dumps(obj) + "\n")
    tmp.rename(src / f"f{i:05d}.json")


def run_variant(variant: str, keys: int, args: Any, base: Path) -> dict[str, Any]:
    work = base / f"{variant}-{keys}"
    src = work / "src"
    src.mkdir(parents=True)
    rng = random.Random(keys)
    n_build = 0
    for lo in range(0, keys, args.build_chunk):
        _write(src, n_build, {"lo": lo, "hi": min(keys, lo + args.build_chunk), "b": 0})
        n_build += 1
    per = max(1, int(keys * args.update))
    for j in range(args.batches + 1):  # the last one: the restart's batch
        ids = rng.sample(range(keys), per)
        if j < args.batches:
            _write(src, n_build + j, {"ids": ids, "b": j + 1})
        else:
            restart_ids = ids
    cfg = {"variant": variant, "work": str(work), "pace_s": args.pace_s,
           "batches": n_build + args.batches, "phase": "run"}
    run = run_child(cfg)
    _write(src, n_build + args.batches, {"ids": restart_ids, "b": args.batches + 1})
    restart = run_child(cfg | {"batches": 1, "phase": "restart"})
    shutil.rmtree(work, ignore_errors=True)
    b = run["batches"]
    build, steady = b[:n_build], b[n_build:]
    steady_cpu = [steady[i]["cpu_s"] - (steady[i - 1] if i else build[-1])["cpu_s"]
                  for i in range(len(steady))]
    first = restart["batches"][0]
    return {
        "keys": keys, "variant": variant,
        "build_s": build[-1]["done_at"] - run["t_query"],
        "build_trigger_s": sum(x["trigger_s"] for x in build),
        "steady_trigger_s": summary([x["trigger_s"] for x in steady]),
        "steady_cpu_s": summary(steady_cpu),
        "steady_bytes": summary([x["new_bytes"] for x in steady]),
        "steady_objects": summary([x["new_objects"] for x in steady]),
        "steady_deltas": sum(1 for x in steady for sn in x["snapshots"] if sn[1] == "delta"),
        "steady_full": sum(1 for x in steady for sn in x["snapshots"] if sn[1] == "full"),
        "bytes_per_interval": statistics.fmean(x["new_bytes"] for x in steady),
        "objects_per_interval": statistics.fmean(x["new_objects"] for x in steady),
        "cpu_per_interval_s": statistics.fmean(steady_cpu),
        "local_disk_bytes": run["local_disk_bytes"], "local_all_bytes": run["local_all_bytes"],
        "store_bytes": run["store_bytes"], "store_objects": run["store_objects"],
        "peak_anon_mb": run["peak_anon_mb"],
        "restart_peak_anon_mb": restart["peak_anon_mb"],
        "peak_anon_by_kind_mb": run["peak_anon_by_kind_mb"],
        "restart_process_s": first["done_at"] - restart["t_process"],
        "restart_query_s": first["done_at"] - restart["t_query"],
        "restart_trigger_s": first["trigger_s"],
        "raw": {"run": run, "restart": restart},
    }


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f}"


def render(results: list[dict[str, Any]], args: Any, note: str) -> str:
    sizes = sorted({r["keys"] for r in results})
    by = {(r["keys"], r["variant"]): r for r in results}
    variants = [v for v in args.variants if any((k, v) in by for k in sizes)]
    lines = ["### State size (`bench/scale.py`)", "",
             "Per size: DSTL (LMDB, agent, deltas) / DSTL with full snapshots / Spark's "
             "aggregation on RocksDB + changelog; ratio = DSTL / Spark, same run.", ""]
    rows = [
        ("store bytes written per steady interval (MB)", "bytes_per_interval", _mb),
        ("store objects written per steady interval", "objects_per_interval",
         lambda x: f"{x:.1f}"),
        ("CPU per steady interval, process tree (s)", "cpu_per_interval_s",
         lambda x: f"{x:.2f}"),
        ("steady batch `triggerExecution` (s, median)", "steady_trigger_s",
         lambda x: f"{x['median']:.2f} ({x['min']:.2f}..{x['max']:.2f})"),
        ("build: query start to the last build batch (s)", "build_s", lambda x: f"{x:.1f}"),
        ("local disk for the state (MB)", "local_disk_bytes", _mb),
        ("store size after the steady batches (MB)", "store_bytes", _mb),
        ("restart: process start to first batch done (s)", "restart_process_s",
         lambda x: f"{x:.1f}"),
        ("restart: query start to first batch done (s)", "restart_query_s",
         lambda x: f"{x:.1f}"),
        ("restart: first batch `triggerExecution` (s)", "restart_trigger_s",
         lambda x: f"{x:.2f}"),
        ("peak anonymous RSS, process tree, build + steady (MB)", "peak_anon_mb",
         lambda x: f"{x:.0f}"),
    ]

    def val(r: dict[str, Any], key: str) -> float:
        v = r[key]
        return float(v["median"] if isinstance(v, dict) else v)

    head = "| figure | keys | " + " | ".join(variants) + " | DSTL / Spark |"
    lines += [head, "|---|---|" + "---|" * len(variants) + "---|"]
    for label, key, f in rows:
        for k in sizes:
            cells = [f(by[(k, v)][key]) if (k, v) in by else "-" for v in variants]
            ratio = "-"
            if (k, "dstl") in by and (k, "spark") in by and val(by[(k, "spark")], key):
                ratio = f"{val(by[(k, 'dstl')], key) / val(by[(k, 'spark')], key):.2f}x"
            lines.append(f"| {label} | {k:,} | " + " | ".join(cells) + f" | {ratio} |")
    for k in sizes:  # results kept before the kinds were sampled have none: "-"
        cells = [" / ".join(f"{kind} {mb:.0f}" for kind, mb in
                            by[(k, v)].get("peak_anon_by_kind_mb", {}).items()) or "-"
                 if (k, v) in by else "-" for v in variants]
        lines.append(f"| at that peak, by process (MB) | {k:,} | " + " | ".join(cells)
                     + " | - |")
    for k in sizes:
        cells = [f"{by[(k, v)]['steady_full']} / {by[(k, v)]['steady_deltas']}"
                 if (k, v) in by and v != "spark" else "-" for v in variants]
        lines.append(f"| DSTL snapshots written in the steady batches (full / deltas) | {k:,} | "
                     + " | ".join(cells) + " | - |")
    lines += ["", f"{args.batches} steady batches updating {args.update:.0%} of the keys, "
              f"paced {args.pace_s:g} s, build chunks of {args.build_chunk:,} keys, "
              f"`local[2]`, {PARTITIONS} partitions, DSTL materialization every "
              f"{INTERVAL_S:g} s; one run per variant and size{' (quick)' if args.quick else ''}"
              f". Spark keeps its 256-byte value per key through its native aggregation "
              f"(`max(value)`), not `transformWithStateInPandas`. {note}"]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        result = child(json.loads(sys.argv[2]))
        Path(sys.argv[3]).write_text(json.dumps(result))
        return
    p = parser(__doc__ or "")
    p.add_argument("--keys", default=None, help="comma-separated state sizes")
    p.add_argument("--large", action="store_true", help="also 16 M keys")
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--update", type=float, default=0.01)
    p.add_argument("--pace-s", type=float, default=5.0)
    p.add_argument("--build-chunk", type=int, default=1_000_000)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--keep", default=None, help="append each result to this JSON-lines file")
    p.add_argument("--render", default=None,
                   help="render the results of a --keep file instead of running")
    p.add_argument("--note", default=None, help="with --render: a sentence added to the note")
    args = p.parse_args()
    args.variants = [v for v in args.variants.split(",") if v]
    if args.quick:
        keys = [20_000]
        if "--batches" not in sys.argv:
            args.batches = 4
        if "--pace-s" not in sys.argv:
            args.pace_s = 2.0
    else:  # 1 M first: the size the figures are compared at, should a run be cut short
        keys = [1_000_000, 200_000, 4_000_000]
    if args.keys:
        keys = [int(k) for k in args.keys.split(",")]
    if args.large:
        keys.append(16_000_000)
    if args.render:  # the results a run kept (--keep), e.g. of a run stopped before its end
        kept = [json.loads(line) for line in Path(args.render).read_text().splitlines() if line]
        done = sorted({r["keys"] for r in kept})
        md = render(kept, args, f"Rendered from the results a run kept (`--keep FILE`, then "
                                f"`--render FILE`): sizes {', '.join(f'{k:,}' for k in done)}; "
                                "the run was stopped before its other sizes finished. " + (
                                    args.note or ""))
        write_results("scale", {"config": dict(vars(args)), "keys": done, "results": kept},
                      md, quick=args.quick, command="python bench/scale.py", no_doc=args.no_doc)
        print(md)
        return
    t0 = time.monotonic()
    load = LoadSampler()
    base = Path(tempfile.mkdtemp(prefix="dstl-bench-scale-", dir=os.environ.get("TMPDIR")))
    results: list[dict[str, Any]] = []
    lock = threading.Lock()
    try:
        for k in keys:
            for v in args.variants:
                if v == "dstl-full" and k > 200_000 and not args.quick:
                    continue  # full snapshots at one size show what deltas save (the run's time)
                t = time.monotonic()
                r = run_variant(v, k, args, base)
                with lock:
                    results.append(r)
                if args.keep:  # each result as it comes: a long run that fails later keeps it
                    with open(args.keep, "a") as f:
                        f.write(json.dumps(r) + "\n")
                print(f"{k:>10,} {v:>9}: {time.monotonic() - t:6.1f}s  "
                      f"{_mb(r['bytes_per_interval'])} MB/interval, "
                      f"cpu {r['cpu_per_interval_s']:.2f} s, restart "
                      f"{r['restart_process_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load.stop()
    note = (f"Total {time.monotonic() - t0:.0f} s. {load.note()}"
            + ("" if args.large else " 16 M keys not run (`--large`)."))
    md = render(results, args, note)
    cmd = "python bench/scale.py" + (" --quick" if args.quick else "")
    if args.keys:
        cmd += f" --keys {args.keys}"
    if args.variants != list(VARIANTS):
        cmd += f" --variants {','.join(args.variants)}"
    for flag, value, default in (("--batches", args.batches, 4 if args.quick else 12),
                                 ("--update", args.update, 0.01),
                                 ("--pace-s", args.pace_s, 2.0 if args.quick else 5.0),
                                 ("--build-chunk", args.build_chunk, 1_000_000)):
        if value != default:
            cmd += f" {flag} {value:g}"
    write_results("scale", {"config": {k: v for k, v in vars(args).items()}, "keys": keys,
                            "results": results, "load": load.summary},
                  md, quick=args.quick, command=cmd, no_doc=args.no_doc)
    print(md)


if __name__ == "__main__":
    main()
