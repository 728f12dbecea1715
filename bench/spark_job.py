"""Spark job benchmark: the DSTL operator vs Spark's own state store, same workload.

One workload, run in the same process on the same machine by each variant:

* ``dstl``       — :class:`dstl.spark.DstlStatefulOperator` in ``foreachBatch``, LMDB tables,
  P partitions, ``agent=False``: every task writes its own segment (one object per partition per checkpoint);
* ``dstl+agent`` — the same operator with its default ``agent=True``: the executor agent
  group-commits the segments of the executor's concurrent tasks;
* ``spark``      — ``groupBy("user").applyInPandasWithState`` (output mode "update",
  ``GroupStateTimeout.NoTimeout``) on ``RocksDBStateStoreProvider`` with changelog
  checkpointing, ``spark.sql.shuffle.partitions = P``.

The workload is a click stream keyed by user (as in :mod:`dstl.spark.demo`): JSON files, one per
micro-batch (``maxFilesPerTrigger=1``, ``trigger(availableNow=True)``); state per user is a click
count and a map page -> clicks; each batch outputs ``user, clicks, distinct_pages`` for the users
it saw. Run 1 processes N files in a fresh SparkSession; the session stops; run 2 starts a fresh
SparkSession (same Python process and driver JVM, new SparkContext, new executor-side state: DSTL
gets a fresh ``local_dir``, so it restores from its store like Spark's RocksDB does from the
checkpoint) on the same Spark checkpoint and DSTL store, with K more files. Every variant's final
per-user results are checked against an independent computation.

Per batch, for every variant: ``triggerExecution`` and ``addBatch`` from the query's
``recentProgress`` (the same clock for all variants), and the files that appeared in the state
location, listed in the ``foreachBatch`` sink after the batch's state is durable (DSTL: after the
manifest; Spark: after the tasks committed their changelogs). DSTL adds ``op.batch_stats``
(batch/commit seconds, objects written = segments + snapshots + 1 manifest, restore seconds);
Spark adds the state operator's ``commitTimeMs`` and RocksDB custom metrics.

Steady state = every batch but the first of each run (run 1's first pays worker start-up and
state creation; run 2's first is the restore, reported on its own). Each repeat is a whole run of
every variant (variant order rotates per repeat); a table cell is the median over repeats of the
per-repeat median, with the min..max over repeats.

Run: ``.venv/bin/python bench/spark_job.py [--quick]`` (one Spark session at a time; on 2 cores
about 1 min quick: 5 + 3 batches, 1 repeat; about 4 min full: 10 + 4 batches, 5 repeats).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
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
)
from dstl.spark.processor import StatefulProcessor, StatefulProcessorHandle  # noqa: E402

OUTPUT_SCHEMA = "user string, clicks long, distinct_pages long"
# pages as a JSON string: a map<string, bigint> field in the state schema fails in the worker on
# pyspark 4.3.0 (EvalConf.state_value_schema -> MapType.fromJson: KeyError 'keyType')
SPARK_STATE_SCHEMA = "clicks long, pages string"
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
VARIANTS = ("dstl", "dstl+agent", "spark")
# Spark's state file names: N.changelog / N.zip / N.delta / N.snapshot, N = batch id + 1
_SPARK_FILE = re.compile(r"^\.?(\d+)(?:_[^.]+)?\.(changelog|zip|delta|snapshot)(\.crc)?$")


# ----------------------------------------------------------------- the per-user logic, twice


class ClickCount(StatefulProcessor):
    """DSTL: clicks per user (value state) and clicks per page (map state)."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.clicks = handle.get_value_state("clicks")
        self.pages = handle.get_map_state("pages")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        per_page = Counter(row["page"] for row in rows)
        for page, c in per_page.items():
            self.pages.put(page, (self.pages.get(page) or 0) + c)
        n = (self.clicks.get() or 0) + sum(per_page.values())
        self.clicks.update(n)
        yield {"user": key, "clicks": n, "distinct_pages": len(self.pages.keys())}


def spark_click_count(key: tuple[Any, ...], pdfs: Iterator[Any], state: Any) -> Iterator[Any]:
    """Spark ``applyInPandasWithState``: the same logic, state = (clicks, JSON {page: clicks})."""
    import pandas as pd

    pages: dict[str, int]
    if state.exists:
        clicks, pages_json = state.get
        pages = json.loads(pages_json)
    else:
        clicks, pages = 0, {}
    for pdf in pdfs:
        clicks += len(pdf)
        for page, c in pdf["page"].value_counts().items():
            pages[page] = pages.get(page, 0) + int(c)
    state.update((clicks, json.dumps(pages)))
    yield pd.DataFrame({"user": [key[0]], "clicks": [clicks], "distinct_pages": [len(pages)]})


# ----------------------------------------------------------------- workload


def make_events(n_files: int, per_file: int, users: int, seed: int) -> list[list[dict[str, Any]]]:
    """The demo job's click stream (the same generator, so the workloads are comparable)."""
    from dstl.spark.demo import click_events

    return click_events(n_files, per_file, users, seed)


#: Modification time of file 0; file N is N seconds later (see write_file).
_MTIME_BASE = 1_700_000_000


def write_file(dirpath: Path, index: int, events: list[dict[str, Any]]) -> None:
    """File ``index`` of the stream. Its modification time is ``index`` seconds after file 0's:
    the file source takes files in modification-time order (``maxFilesPerTrigger=1``: one per
    batch), and files written in the same millisecond would otherwise come in any order — a
    batch of later clicks first moves the watermark past earlier ones, which then are late
    (``bench/tws.py``'s two variants emitted different sessions in some runs)."""
    tmp = dirpath / f".part-{index:05d}.json.tmp"
    tmp.write_text("".join(json.dumps(e) + "\n" for e in events))
    os.utime(tmp, (_MTIME_BASE + index, _MTIME_BASE + index))
    os.replace(tmp, dirpath / f"part-{index:05d}.json")


def expected_results(files: list[list[dict[str, Any]]]) -> dict[str, tuple[int, int]]:
    clicks: Counter[str] = Counter()
    pages: dict[str, set[str]] = defaultdict(set)
    for batch in files:
        for e in batch:
            clicks[e["user"]] += 1
            pages[e["user"]].add(e["page"])
    return {u: (clicks[u], len(pages[u])) for u in clicks}


def list_files(root: Path) -> set[str]:
    if not root.exists():
        return set()
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


# ----------------------------------------------------------------- one phase of one variant


def new_session(name: str, partitions: int) -> Any:
    from pyspark.sql import SparkSession

    # workers run this interpreter and import this module (the processor and the pandas
    # function are referenced as bench.spark_job.*, so they are shipped by reference)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    paths = [str(ROOT), str(ROOT / "bench"), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
    spark = (SparkSession.builder.master("local[2]").appName(name)
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "1g")
             .config("spark.sql.shuffle.partitions", str(partitions))
             .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
             .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled",
                     "true")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def run_phase(variant: str, phase: int, work: Path, partitions: int,
              final: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """One SparkSession: process every file not yet processed; per-batch figures."""
    mod: Any = importlib.import_module("bench.spark_job")
    src, ck, state = work / "src", work / "checkpoint", work / "state"
    watched = ck / "state" if variant == "spark" else state
    t0 = time.monotonic()
    spark = new_session(f"bench-{variant}-{phase}", partitions)
    session_s = time.monotonic() - t0
    seen = list_files(watched)
    listing: dict[int, dict[str, Any]] = {}

    def deliver(out_df: Any, batch_id: int) -> None:
        # the "sink" of both variants: outputs to the driver, then list the state location
        for r in out_df.collect():
            final[r["user"]] = (int(r["clicks"]), int(r["distinct_pages"]))
        t = time.monotonic()
        now = list_files(watched)
        new = sorted(now - seen)
        listing[batch_id] = {"new_files": new, "gone": len(seen - now),
                             "list_seconds": time.monotonic() - t}
        seen.clear()
        seen.update(now)

    op: Any = None
    try:
        stream = (spark.readStream.schema("user string, page string, ts long")
                  .option("maxFilesPerTrigger", 1).json(str(src)))
        if variant == "spark":
            from pyspark.sql.streaming.state import GroupStateTimeout

            writer = (stream.groupBy("user")
                      .applyInPandasWithState(mod.spark_click_count, OUTPUT_SCHEMA,
                                              SPARK_STATE_SCHEMA, "update",
                                              GroupStateTimeout.NoTimeout)
                      .writeStream.outputMode("update").foreachBatch(deliver))
        else:
            from dstl.spark import DstlStatefulOperator

            local_dir = work / f"local-{phase}"  # a fresh executor-local dir per session
            op = DstlStatefulOperator(name="clicks", processor=mod.ClickCount, key_column="user",
                                      output_schema=OUTPUT_SCHEMA, state_uri=str(state),
                                      partitions=partitions, max_parallelism=128, table="lmdb",
                                      sink=deliver, local_dir=str(local_dir),
                                      agent=variant == "dstl+agent")
            op.validate(spark)
            writer = stream.writeStream.foreachBatch(op.foreach_batch)
        q = (writer.option("checkpointLocation", str(ck)).trigger(availableNow=True).start())
        q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(f"{variant} run {phase} failed: {q.exception()}")
        progress = [json.loads(p.json) for p in q.recentProgress]
        dstl_stats = {s["batch_id"]: s for s in op.batch_stats} if op is not None else {}
    finally:
        if op is not None:
            op.close()
        spark.stop()
    batches = []
    for p in progress:
        if p.get("numInputRows", 0) == 0:
            continue
        b = int(p["batchId"])
        d = p.get("durationMs", {})
        row: dict[str, Any] = {
            "batch_id": b, "rows": p["numInputRows"],
            "trigger_s": d.get("triggerExecution", 0) / 1e3, "add_batch_s": d.get("addBatch", 0) / 1e3,
            "new_files": listing.get(b, {}).get("new_files", []),
            "list_s": listing.get(b, {}).get("list_seconds", 0.0),
        }
        ops = p.get("stateOperators") or []
        if ops:
            row["state_commit_s"] = sum(o.get("commitTimeMs", 0) for o in ops) / 1e3
            row["state_updates_s"] = sum(o.get("allUpdatesTimeMs", 0) for o in ops) / 1e3
            row["state_rows_total"] = sum(o.get("numRowsTotal", 0) for o in ops)
            row["custom_metrics"] = ops[0].get("customMetrics", {})
        if b in dstl_stats:
            s = dstl_stats[b]
            row.update({k: s[k] for k in ("batch_seconds", "job_seconds", "commit_seconds",
                                          "objects_written", "segments", "materializations",
                                          "bytes_written", "restore_seconds", "accesses",
                                          "deleted")})
        batches.append(row)
    return {"session_s": session_s, "batches": sorted(batches, key=lambda r: r["batch_id"])}


def spark_objects(rel_paths: list[str]) -> dict[str, int]:
    """Classify Spark state files: changelogs, zips, SSTs, metadata, and their .crc files."""
    out: Counter[str] = Counter()
    for rel in rel_paths:
        name = rel.rsplit("/", 1)[-1]
        crc = name.endswith(".crc")
        m = _SPARK_FILE.match(name)
        kind = m.group(2) if m else ("sst" if "/SSTs/" in f"/{rel}" else "metadata")
        out[kind + (".crc" if crc else "")] += 1
    return dict(out)


def run_variant(variant: str, files: list[list[dict[str, Any]]], n1: int, partitions: int,
                base: Path) -> dict[str, Any]:
    work = base / variant.replace("+", "-")
    (work / "src").mkdir(parents=True)
    final: dict[str, tuple[int, int]] = {}
    for i in range(n1):
        write_file(work / "src", i, files[i])
    run1 = run_phase(variant, 1, work, partitions, final)
    for i in range(n1, len(files)):
        write_file(work / "src", i, files[i])
    run2 = run_phase(variant, 2, work, partitions, final)
    watched = work / "checkpoint" / "state" if variant == "spark" else work / "state"
    present = sorted(list_files(watched))
    if variant == "spark":
        present_kinds = spark_objects(present)
    else:
        present_kinds = dict(Counter(p.split("/", 1)[0] for p in present))
    exact = final == expected_results(files)
    shutil.rmtree(work, ignore_errors=True)
    return {"run1": run1, "run2": run2, "exact": exact, "present_files": len(present),
            "present_crc": sum(1 for p in present if p.endswith(".crc")),
            "present_kinds": present_kinds}


# ----------------------------------------------------------------- figures


def steady(result: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = result["run1"]["batches"][1:] + result["run2"]["batches"][1:]
    return out


def per_repeat_median(results: list[dict[str, Any]], field: str) -> list[float]:
    out = []
    for r in results:
        xs = [float(b[field]) for b in steady(r) if field in b]
        if xs:
            out.append(statistics.median(xs))
    return out


def files_per_batch(b: dict[str, Any], crc: bool) -> int:
    return sum(1 for f in b["new_files"] if f.endswith(".crc") == crc)


def figures_for(variant: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    for r in results:
        for b in r["run1"]["batches"] + r["run2"]["batches"]:
            b["files"] = files_per_batch(b, crc=False)
            b["crc_files"] = files_per_batch(b, crc=True)
    fields = ["trigger_s", "add_batch_s", "files", "crc_files"]
    fields += (["batch_seconds", "commit_seconds", "objects_written", "segments"]
               if variant != "spark" else ["state_commit_s", "state_updates_s"])
    f: dict[str, Any] = {}
    for name in fields:
        xs = per_repeat_median(results, name)
        if xs:
            f[name] = summary(xs)
    firsts = [r["run2"]["batches"][0] for r in results]
    f["restart_trigger_s"] = summary([b["trigger_s"] for b in firsts])
    f["restart_add_batch_s"] = summary([b["add_batch_s"] for b in firsts])
    f["restart_files"] = summary([float(b["files"]) for b in firsts])
    f["first_batch_trigger_s"] = summary([r["run1"]["batches"][0]["trigger_s"] for r in results])
    f["first_batch_files"] = summary([float(r["run1"]["batches"][0]["files"]) for r in results])
    if variant != "spark":
        f["restore_s"] = summary([b["restore_seconds"] for b in firsts])
        f["restart_batch_seconds"] = summary([b["batch_seconds"] for b in firsts])
        f["restart_accesses"] = [b["accesses"] for b in firsts]
        f["materializations"] = sum(b.get("materializations", 0) for r in results
                                    for b in r["run1"]["batches"] + r["run2"]["batches"])
    else:
        cm = [b.get("custom_metrics", {}) for b in firsts]
        f["restart_rocksdb_load_s"] = summary([float(c.get("rocksdbLoadLatencyMs", 0)) / 1e3
                                               for c in cm])
        f["restart_custom_metrics"] = cm
    f["session_start_s"] = summary([r[k]["session_s"] for r in results for k in ("run1", "run2")])
    f["exact"] = all(r["exact"] for r in results)
    f["present_files"] = [r["present_files"] for r in results]
    f["present_crc"] = [r["present_crc"] for r in results]
    f["present_kinds"] = [r["present_kinds"] for r in results]
    f["steady_batches_per_repeat"] = len(steady(results[0]))
    return f


def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> str:
    x, y = a.get(key), b.get(key)
    if not x or not y or not y["median"]:
        return ""
    return f"{x['median'] / y['median']:.2f}x"


def markdown(figures: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures."""
    figs, c = figures["summary"], figures["config"]
    sp = figs.get("spark", {})
    dv = [v for v in VARIANTS if v in figs and v != "spark"]

    def cell(v: str, key: str, scale: float, digits: int) -> str:
        s = figs.get(v, {}).get(key)
        return fmt(s, scale=scale, digits=digits) if s else "-"

    rows = []
    for label, key, scale, digits in (
            ("steady batch `triggerExecution` (ms)", "trigger_s", 1e3, 0),
            ("steady batch: new state files (Spark without `.crc`)", "files", 1.0, 1),
            ("first batch of the query (ms)", "first_batch_trigger_s", 1e3, 0),
            ("**restart**: first batch `triggerExecution` (ms)", "restart_trigger_s", 1e3, 0)):
        rows.append([label, *(cell(v, key, scale, digits) for v in dv),
                     cell("spark", key, scale, digits), *(ratio(figs[v], sp, key) for v in dv)])
    goal = ""
    if sp and dv:
        best = min(figs[v]["trigger_s"]["median"] / sp["trigger_s"]["median"] for v in dv)
        goal = (" Goal: a steady batch no slower than Spark's: "
                + ("met" if best <= 1.0 else "**missed**") + ".")
    exact = ", ".join(f"`{v}` {'yes' if figs[v]['exact'] else '**no**'}" for v in figs)
    return "\n".join([
        table(["figure", *(f"`{v}`" for v in dv), "Spark RocksDB + changelog",
               *(f"`{v}` / Spark" for v in dv)], rows), "",
        f"{c['batches']} + {c['restart_batches']} micro-batches (a restart between) of "
        f"{c['events']:,} clicks, P = {c['partitions']}, `local[2]`; median (min..max) over "
        f"{c['repeats']} repeats of each run's median steady batch. `dstl` = per-task segments, "
        f"`dstl+agent` = the default. Results exact: {exact}.{goal}",
    ])


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--batches", type=int, default=None, help="micro-batches in run 1")
    p.add_argument("--restart-batches", type=int, default=None, help="micro-batches in run 2")
    p.add_argument("--events", type=int, default=3000, help="clicks per micro-batch")
    p.add_argument("--users", type=int, default=500)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--variants", default=",".join(VARIANTS))
    add_render(p)
    args = p.parse_args()
    if args.render:
        render_stored("spark_job", Path(args.render), markdown)
        return
    q = args.quick
    n1 = args.batches or (5 if q else 10)
    k = args.restart_batches or (3 if q else 4)
    repeats = 1 if q and "--repeats" not in sys.argv else args.repeats
    variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in variants):
        p.error(f"--variants: choose from {', '.join(VARIANTS)}")
    t0 = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="dstl-bench-spark-"))
    raw: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for rep in range(repeats):
            files = make_events(n1 + k, args.events, args.users, seed=42 + rep)
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for v in order:
                t = time.monotonic()
                res = run_variant(v, files, n1, args.partitions, base / f"r{rep}")
                raw[v].append(res)
                steady_t = [b["trigger_s"] for b in steady(res)]
                print(f"repeat {rep + 1}/{repeats} {v:>10}: {time.monotonic() - t:5.1f}s, "
                      f"steady trigger median {statistics.median(steady_t) * 1e3:.0f} ms, "
                      f"exact={res['exact']}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    figs = {v: figures_for(v, raw[v]) for v in variants}
    total = time.monotonic() - t0
    figures = {"config": {"batches": n1, "restart_batches": k, "events": args.events,
                          "users": args.users, "partitions": args.partitions,
                          "repeats": repeats, "variants": variants,
                          "spark_conf": {"spark.sql.streaming.stateStore.providerClass":
                                         ROCKSDB_PROVIDER,
                                         "spark.sql.streaming.stateStore.rocksdb."
                                         "changelogCheckpointing.enabled": "true",
                                         "spark.sql.shuffle.partitions": args.partitions}},
               "summary": figs, "raw": raw, "total_s": total}
    publish("spark_job", figures, markdown, quick=q,
            command=f"python bench/spark_job.py{' --quick' if q else ''}", no_doc=args.no_doc)


if __name__ == "__main__":
    main()
