"""The main demo job (``make demo`` / ``python -m dstl demo``).

A generated click stream keyed by user (JSON files, one micro-batch each) runs through a per-user
stateful aggregation whose state lives in DSTL: clicks per user, distinct pages (map state) and
the last page. The job processes the first files, stops, and a fresh SparkSession restarts it on
the same Spark checkpoint and DSTL store: the state comes back from the store (materialized
snapshot + log), the rest of the stream is processed, and the final per-user results are compared
with an independent computation over all events. A per-batch table shows what DSTL did.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

from dstl.errors import ConfigError
from dstl.spark.processor import StatefulProcessor, StatefulProcessorHandle
from dstl.spark.timing import TimerValues
from dstl.stores import parse_storage_options

PAGES = ["/", "/search", "/item", "/cart", "/checkout", "/help", "/account", "/deals"]


class ClickStats(StatefulProcessor):
    """Per user: clicks, distinct pages, last page."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.clicks = handle.get_value_state("clicks")
        self.pages = handle.get_map_state("pages")
        self.last = handle.get_value_state("last_page")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: TimerValues | None = None) -> Iterator[dict[str, Any]]:
        n = self.clicks.get() or 0
        last = None
        for row in rows:
            n += 1
            page = row["page"]
            self.pages.put(page, (self.pages.get(page) or 0) + 1)
            last = page
        self.clicks.update(n)
        if last is not None:
            self.last.update(last)
        yield {"user": key, "clicks": n, "distinct_pages": len(self.pages.keys()),
               "last_page": self.last.get()}


def click_events(n_files: int, per_file: int, users: int, seed: int
                 ) -> list[list[dict[str, Any]]]:
    """Deterministic click events, one list per micro-batch file (heavy-tailed users)."""
    rng = random.Random(seed)
    files = []
    t = 1_700_000_000_000
    for _ in range(n_files):
        batch = []
        for _ in range(per_file):
            t += rng.randint(1, 20)
            batch.append({"user": f"user-{int(rng.paretovariate(1.2) * 7) % users:05d}",
                          "page": rng.choice(PAGES), "ts": t})
        files.append(batch)
    return files


def _write(dirpath: str, index: int, events: list[dict[str, Any]]) -> None:
    tmp = os.path.join(dirpath, f".part-{index:05d}.json.tmp")
    with open(tmp, "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")
    os.replace(tmp, os.path.join(dirpath, f"part-{index:05d}.json"))


def _session(name: str, partitions: int, master: str) -> Any:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers use this interpreter
    return (SparkSession.builder.master(master).appName(name)
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", str(partitions))
            .config("spark.sql.streaming.forceDeleteTempCheckpointLocation", "true")
            .config("spark.driver.memory", "1g")
            .getOrCreate())


def _run_phase(label: str, src: str, ck: str, state_uri: str, storage_options: Any,
               partitions: int, table: str, final: dict[str, dict[str, Any]], master: str
               ) -> list[dict[str, Any]]:
    from dstl.spark.operator import DstlStatefulOperator

    spark = _session(f"dstl-demo-{label}", partitions, master)
    spark.sparkContext.setLogLevel("ERROR")

    def sink(out_df: Any, batch_id: int) -> None:
        for r in out_df.collect():
            final[r["user"]] = r.asDict()

    op = DstlStatefulOperator(name="clicks", processor=ClickStats, key_column="user",
                              output_schema="user string, clicks long, distinct_pages long, "
                                            "last_page string",
                              state_uri=state_uri, storage_options=storage_options,
                              partitions=partitions, max_parallelism=128, table=table,
                              sink=sink, materialization_interval_s=1.0)
    try:
        op.validate(spark)
        stream = (spark.readStream.schema("user string, page string, ts long")
                  .option("maxFilesPerTrigger", 1).json(src))
        q = (stream.writeStream.foreachBatch(op.foreach_batch)
             .option("checkpointLocation", ck).trigger(availableNow=True).start())
        q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(f"query failed: {q.exception()}")
        return op.batch_stats
    finally:
        op.close()
        spark.stop()


def _table(rows: list[dict[str, Any]], label: str) -> None:
    print(f"\n{label}")
    print(f"{'batch':>5} {'rows':>6} {'batch s':>8} {'DSTL commit ms':>15} {'objects':>8} "
          f"{'bytes':>9} {'materialized':>13} {'restores':>9} {'state open ms':>14}")
    for s in rows:
        print(f"{s['batch_id']:>5} {s['rows_in']:>6} {s['batch_seconds']:>8.2f} "
              f"{s['commit_seconds'] * 1e3:>15.1f} {int(s['objects_written']):>8} "
              f"{int(s['bytes_written']):>9,} {s['materializations']:>13} {s['restores']:>9} "
              f"{s['restore_seconds'] * 1e3:>14.1f}")
    print("(DSTL commit = slowest task's wait for its log to be durable + the driver's manifest; "
          "objects = log segments + snapshots installed + 1 manifest; materialized = snapshots "
          "installed into the checkpoint; state open = hit/adopt/restore time, "
          "max over tasks)")
    agents: dict[int, dict[str, float]] = {}
    for s in rows:
        agents.update(s.get("agents") or {})
    for pid, m in sorted(agents.items()):
        print(f"executor agent pid {pid}: {int(m.get('agent.requests', 0))} requests, "
              f"{int(m.get('agent.ChangelogStorage.numberOfSegments', 0))} segments, "
              f"{m.get('agent.ChangelogStorage.writersPerSegment.mean', 0.0):.2f} writers per "
              f"segment (mean), upload p50 "
              f"{m.get('agent.ChangelogStorage.uploadLatenciesSeconds.p50', 0.0) * 1e3:.1f} ms; "
              f"{int(m.get('agent.materializer.completed', 0))} snapshots of "
              f"{int(m.get('agent.materializer.partitions', 0))} partitions "
              f"({int(m.get('agent.materializer.failed', 0))} failed, last "
              f"{m.get('agent.materializer.lastDurationMs', 0.0):.0f} ms); restore cache "
              f"{int(m.get('agent.cache.downloads', 0))} downloads, "
              f"{int(m.get('agent.cache.hits', 0))} hits")


def run(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    work = tempfile.mkdtemp(prefix="dstl-demo-", dir=args.work_dir)
    src = os.path.join(work, "clicks")
    ck = os.path.join(work, "spark-checkpoint")
    os.makedirs(src)
    state_uri = args.state_uri or os.path.join(work, "state")
    storage_options = {**(json.loads(args.storage_options) if args.storage_options else {}),
                       **(args.storage_option_values or {})} or None
    files = click_events(args.files, args.events, args.users, args.seed)
    print(f"DSTL demo: {args.files} micro-batches of {args.events} clicks by {args.users} users, "
          f"{args.partitions} partitions, {args.table} tables, store {state_uri}")
    t0 = time.monotonic()
    final: dict[str, dict[str, Any]] = {}
    try:
        for i in range(args.restart_after):
            _write(src, i, files[i])
        first = _run_phase("run-1", src, ck, state_uri, storage_options, args.partitions,
                           args.table, final, args.master)
        _table(first, "run 1 (fresh state):")
        for i in range(args.restart_after, args.files):
            _write(src, i, files[i])
        second = _run_phase("run-2", src, ck, state_uri, storage_options, args.partitions,
                            args.table, final, args.master)
        _table(second, "run 2 (a new SparkSession; state restored from the store):")
        expected = _expected_results(files)
        objs = sum(s["objects_written"] for s in first + second)
        batches = len(first) + len(second)
        print(f"\n{len(expected)} users, {sum(c for c, _, _ in expected.values())} clicks; DSTL "
              f"wrote {objs} objects in {batches} batches ({objs / max(1, batches):.1f} per "
              f"batch, {args.partitions} partitions); total {time.monotonic() - t0:.0f}s")
        return 0 if _check(final, expected) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dstl demo", description=__doc__)
    p.add_argument("--state-uri", default=None, help="DSTL store (default: a temp directory)")
    p.add_argument("--storage-options", default=None, help="JSON fsspec options (S3 etc.)")
    p.add_argument("--storage-option", action="append", metavar="KEY=VALUE", default=[],
                   help="one fsspec option, repeatable (dotted keys nest, JSON values parsed; "
                        "dstl.stores.parse_storage_options)")
    p.add_argument("--files", type=int, default=8, help="micro-batches in all")
    p.add_argument("--restart-after", type=int, default=4, help="stop after this many batches")
    p.add_argument("--events", type=int, default=3000, help="events per micro-batch")
    p.add_argument("--users", type=int, default=500)
    p.add_argument("--partitions", type=int, default=4)
    p.add_argument("--table", choices=["lmdb", "heap"], default="lmdb")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--master", default="local[2]",
                   help="Spark master URL, e.g. spark://host:7077 for a standalone cluster "
                        "(its executors must reach the input and work directory: --work-dir)")
    p.add_argument("--work-dir", default=None,
                   help="directory of the input files and Spark's checkpoint, removed at the "
                        "end (default: a new temp directory)")
    args = p.parse_args(argv)
    try:
        args.storage_option_values = parse_storage_options(args.storage_option)
    except ConfigError as exc:
        p.error(str(exc))
    return args


def _expected_results(files: list[list[dict[str, Any]]]) -> dict[str, tuple[int, int, str]]:
    """Per user (clicks, distinct pages, last page), computed directly from the events."""
    clicks: Counter[str] = Counter()
    pages: dict[str, set[str]] = defaultdict(set)
    last: dict[str, str] = {}
    for batch in files:
        for e in batch:
            clicks[e["user"]] += 1
            pages[e["user"]].add(e["page"])
            last[e["user"]] = e["page"]
    return {u: (clicks[u], len(pages[u]), last[u]) for u in clicks}


def _check(final: dict[str, dict[str, Any]],
           expected: dict[str, tuple[int, int, str]]) -> bool:
    """Compare the job's final rows with the independent computation; print the verdict."""
    got = {u: (r["clicks"], r["distinct_pages"], r["last_page"]) for u, r in final.items()}
    ok = got == expected
    print("check against an independent computation:", "OK" if ok else "MISMATCH")
    if not ok:
        bad = [u for u in expected if got.get(u) != expected[u]][:5]
        for u in bad:
            print(f"  {u}: expected {expected[u]}, got {got.get(u)}", file=sys.stderr)
    return ok
