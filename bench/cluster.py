"""Cluster benchmark: the demo job on a 2-executor cluster vs Spark's RocksDB store.

One cluster (``local-cluster[2,1,1024]``: two executor JVMs, one core each, see
``tests/support/spark_cluster.py``) runs, in the same run and in turns, these variants of one
click stream (:func:`dstl.spark.demo.click_events`: JSON files, one per micro-batch,
``maxFilesPerTrigger=1``, ``trigger(availableNow=True)``):

* ``dstl``       — the demo job: :class:`dstl.spark.demo.ClickStats` (clicks, a map of distinct
  pages, the last page per user) in :class:`~dstl.spark.DstlStatefulOperator`, LMDB tables, the
  executor agents (one per executor) group-committing segments, a store on the local disk;
* ``dstl-s3``    — the same with the store on S3 (a moto server in this process, through s3fs);
* ``spark``      — ``groupBy("user").count()`` (output mode ``update``) on Spark's
  ``RocksDBStateStoreProvider`` with changelog checkpointing, its checkpoint on the local disk.

The Spark variant keeps less state (one count per user instead of a count, a map and a string)
and runs no Python per row: it is the floor a JVM-only stateful aggregation sets, not the same
job. Per batch, for every variant: ``triggerExecution`` from the query's ``recentProgress`` (the
same clock for all), and the objects the batch added to its state location (DSTL: the
operator's ``objects_written`` = segments + snapshots installed + 1 manifest; Spark: the files
that appeared under the checkpoint's ``state/``, ``.crc`` files counted apart). Steady state =
every batch but the first of a query (the first pays state creation; for DSTL also its
Python workers' first import). Each repeat runs every variant once, the order rotated; a cell is
the median over repeats of the per-repeat median over steady batches, with min..max over repeats.
The final per-user counts of every variant are checked against an independent computation.

The agents materialize every 10 s (``materialization_interval_s=10``): a snapshot is an object of
the batch that installs it. Each variant's query gets a fresh store and checkpoint; the cluster
(and so its executors' agents and Python workers) is the same for all.

Run: ``nice -n 10 .venv/bin/python bench/cluster.py [--quick]`` (quick: 5 batches of 500 clicks;
full: 10 batches of 3,000 clicks; 5 repeats each).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from bench._common import (  # noqa: E402
    LoadSampler,
    add_render,
    fmt,
    load_brief,
    other_jvms,
    parser,
    publish,
    render_stored,
    summary,
    table,
)
from bench.spark_job import ROCKSDB_PROVIDER, list_files, spark_objects, write_file  # noqa: E402

VARIANTS = ("dstl", "dstl-s3", "spark")
PARTITIONS = 4


def _query(spark: Any, variant: str, work: Path, store: tuple[str, Any],
           final: dict[str, int]) -> dict[str, Any]:
    """Run one variant's query over every file in ``work/src``; its per-batch figures."""
    from dstl.spark import DstlStatefulOperator
    from dstl.spark.demo import ClickStats

    watched = work / "checkpoint" / "state"
    seen: set[str] = set()
    listing: dict[int, list[str]] = {}

    def deliver(out_df: Any, batch_id: int) -> None:
        for r in out_df.collect():
            row = r.asDict()
            final[row["user"]] = int(row["clicks"] if "clicks" in row else row["count"])
        now = list_files(watched)
        listing[batch_id] = sorted(now - seen)
        seen.update(now)

    stream = (spark.readStream.schema("user string, page string, ts long")
              .option("maxFilesPerTrigger", 1).json(str(work / "src")))
    op: Any = None
    if variant == "spark":
        writer = stream.groupBy("user").count().writeStream.outputMode("update")
    else:
        op = DstlStatefulOperator(
            name="clicks", processor=ClickStats, key_column="user",
            output_schema="user string, clicks long, distinct_pages long, last_page string",
            state_uri=store[0], storage_options=store[1], partitions=PARTITIONS,
            max_parallelism=128, table="lmdb", sink=deliver, materialization_interval_s=10.0)
        writer = stream.writeStream
    try:
        q = (writer.foreachBatch(deliver if op is None else op.foreach_batch)
             .option("checkpointLocation", str(work / "checkpoint"))
             .trigger(availableNow=True).start())
        q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(f"{variant} failed: {q.exception()}")
        progress = [json.loads(p.json) for p in q.recentProgress]
        stats = {s["batch_id"]: s for s in op.batch_stats} if op is not None else {}
    finally:
        if op is not None:
            op.close()
    batches = []
    for p in progress:
        if p.get("numInputRows", 0) == 0:
            continue
        b = int(p["batchId"])
        row: dict[str, Any] = {"batch_id": b, "trigger_s": p["durationMs"]["triggerExecution"] / 1e3}
        if b in stats:
            s = stats[b]
            row.update(objects=s["objects_written"], segments=s["segments"],
                       materializations=s["materializations"],
                       agents=len({t["agent_pid"] for t in s["tasks"]}),
                       restores=s["restores"])
        else:
            files = listing.get(b, [])
            kinds = spark_objects(files)
            row.update(objects=sum(v for k, v in kinds.items() if not k.endswith(".crc")),
                       crc=sum(v for k, v in kinds.items() if k.endswith(".crc")), kinds=kinds)
        batches.append(row)
    return {"batches": sorted(batches, key=lambda r: r["batch_id"])}


def _run_variant(spark: Any, variant: str, files: list[list[dict[str, Any]]], base: Path,
                 s3: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
    work = base / variant
    (work / "src").mkdir(parents=True)
    for i, events in enumerate(files):
        write_file(work / "src", i, events)
    if variant == "dstl-s3":
        assert s3 is not None
        store: tuple[str, Any] = (f"s3://{s3[0]}/{base.name}", s3[1])
    else:
        store = (str(work / "store"), None)
    final: dict[str, int] = {}
    result = _query(spark, variant, work, store, final)
    expected = Counter(e["user"] for batch in files for e in batch)
    result["exact"] = final == dict(expected)
    shutil.rmtree(work, ignore_errors=True)
    return result


def _figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    def med(field: str) -> dict[str, float] | None:
        xs = [statistics.median(float(b[field]) for b in r["batches"][1:] if field in b)
              for r in results if any(field in b for b in r["batches"][1:])]
        return summary(xs) if xs else None

    return {"batch_s": med("trigger_s"), "objects": med("objects"), "segments": med("segments"),
            "crc": med("crc"), "first_batch_s": summary([r["batches"][0]["trigger_s"]
                                                          for r in results]),
            "agents": max((b.get("agents", 0) for r in results for b in r["batches"]),
                          default=0),
            "exact": all(r["exact"] for r in results)}


def _markdown(figs: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures."""
    def cell(v: str, key: str, scale: float = 1.0, unit: str = "", digits: int = 2) -> str:
        f = figs[v].get(key)
        return fmt(f, unit, scale, digits) if f else "—"

    def ratio(key: str) -> str:
        d, sp = figs["dstl"].get(key), figs["spark"].get(key)
        return f"{d['median'] / sp['median']:.2f}x" if d and sp and sp["median"] > 0 else "—"

    rows = [["steady batch `triggerExecution`", cell("dstl", "batch_s", 1e3, "ms", 0),
             cell("dstl-s3", "batch_s", 1e3, "ms", 0), cell("spark", "batch_s", 1e3, "ms", 0),
             ratio("batch_s")],
            ["objects per batch (Spark: without `.crc`)", cell("dstl", "objects", digits=1),
             cell("dstl-s3", "objects", digits=1), cell("spark", "objects", digits=1),
             ratio("objects")],
            ["first batch of a query", cell("dstl", "first_batch_s", 1e3, "ms", 0),
             cell("dstl-s3", "first_batch_s", 1e3, "ms", 0),
             cell("spark", "first_batch_s", 1e3, "ms", 0), ratio("first_batch_s")],
            ["final counts exact", figs["dstl"]["exact"], figs["dstl-s3"]["exact"],
             figs["spark"]["exact"], ""]]
    runs = figs.get("runs", {}).get("dstl", [])
    batches = len(runs[0]["batches"]) if runs else "?"
    return "\n".join([
        table(["figure", "dstl", "dstl-s3", "spark (same run)", "dstl / spark"], rows), "",
        f"{batches} micro-batches, {PARTITIONS} partitions, `local-cluster[2,1,1024]`; median "
        f"(min..max) over {len(runs)} repeats. `dstl` = the demo job (three states per user), "
        "store on local disk, `dstl-s3` on moto S3; `spark` = a JVM-only "
        f"`groupBy(\"user\").count()` on RocksDB; {load_brief(figs.get('load'))}.",
    ])


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=None)
    p.add_argument("--events", type=int, default=None)
    p.add_argument("--users", type=int, default=500)
    add_render(p)
    args = p.parse_args()
    if args.render:
        render_stored("cluster", Path(args.render), _markdown)
        return
    args.files = args.files or (5 if args.quick else 10)
    args.events = args.events or (500 if args.quick else 3000)
    repeats = max(1, args.repeats)

    from support.moto_server import create_bucket, s3_storage_options, start_moto_server
    from support.spark_cluster import drop_gateway, kill, new_cluster_session, processes_under

    from dstl.spark.demo import click_events

    files = click_events(args.files, args.events, args.users, seed=17)
    base = Path(tempfile.mkdtemp(prefix="dstl-bench-cluster-"))
    server, endpoint = start_moto_server()
    bucket = create_bucket(endpoint, "dstl-bench-cluster")
    jvms_before = other_jvms()
    sampler = LoadSampler()
    spark = new_cluster_session("bench-cluster", base / "cluster",
                                conf={"spark.sql.shuffle.partitions": str(PARTITIONS),
                                      "spark.sql.streaming.stateStore.providerClass":
                                          ROCKSDB_PROVIDER,
                                      "spark.sql.streaming.stateStore.rocksdb."
                                      "changelogCheckpointing.enabled": "true"})
    results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    t0 = time.monotonic()
    try:
        for rep in range(repeats):
            order = VARIANTS[rep % 3:] + VARIANTS[:rep % 3]
            for v in order:
                run_dir = base / f"r{rep}"
                run_dir.mkdir(exist_ok=True)
                r = _run_variant(spark, v, files, run_dir, (bucket, s3_storage_options(endpoint)))
                results[v].append(r)
                print(f"repeat {rep} {v}: " + ", ".join(
                    f"{b['trigger_s']:.2f}s/{b['objects']}" for b in r["batches"])
                    + f" exact={r['exact']}", flush=True)
    finally:
        spark.stop()
        drop_gateway()
        kill(processes_under([base]))
        server.stop()
        shutil.rmtree(base, ignore_errors=True)
    load = sampler.stop()
    figs = {v: _figures(results[v]) for v in VARIANTS}
    figs["load"] = load
    figs["other_jvms_at_start"] = jvms_before
    figs["total_s"] = time.monotonic() - t0
    figs["runs"] = results
    figs["config"] = {"files": args.files, "events": args.events, "users": args.users,
                      "repeats": repeats}
    publish("cluster", figs, _markdown, quick=args.quick,
            command="nice -n 10 .venv/bin/python bench/cluster.py"
            + (" --quick" if args.quick else ""), no_doc=args.no_doc, tag=args.tag)
    if not all(figs[v]["exact"] for v in VARIANTS):
        raise SystemExit("a variant's final counts differ from the independent computation")


if __name__ == "__main__":
    main()
