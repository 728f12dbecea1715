"""Sessionization with event-time timers: the DSTL operator vs Spark's
``transformWithStateInPandas`` on RocksDB (changelog checkpointing), same logic, same run.

Workload: clicks ``(user, ts)`` in JSON files, one per micro-batch (``maxFilesPerTrigger=1``,
``trigger(availableNow=True)``), event time advancing ~1 s per click with a pause longer than
the session gap every third file; no late clicks (Spark filters late rows with the previous
batch's watermark and evicts with the current one, DSTL uses the current one for both, so late
rows in between would make the outputs differ by design, not by error). Logic, written twice
(:class:`Sessions` for DSTL, :class:`SparkSessions` for Spark's API): per user the open session
``(start, end, clicks)`` and an event-time timer at ``end + GAP``; a timer emits the session and
clears it. Spark calls ``handleInputRows`` before the timers and DSTL after them, so the input
handler also closes a session the watermark already passed: the two then emit the same sessions.
Spark's no-data batches are disabled (``foreachBatch`` runs none for DSTL either), so both fire
timers only in data batches. The emitted sessions of the two variants must be equal (checked).

Run 1 processes N files in a fresh SparkSession; run 2 starts a fresh SparkSession on the same
checkpoint/store (DSTL with a fresh ``local_dir``: it restores from its store) with K more files.
Per batch: ``triggerExecution`` from the query progress (the same clock for both), and the CPU
seconds the whole process tree used (the driver, its JVM, Spark's Python workers, DSTL's agents;
:func:`bench._common.tree_cpu_s`) from the end of the previous batch's sink to the end of this
one's: on a shared machine other jobs inflate wall time far more than CPU time. Steady = every
batch but the first of each run; restart = run 2's first batch. Each repeat runs both variants
(order rotated); cell = median over repeats of the per-repeat median (min..max).

Run: ``nice -n 10 .venv/bin/python bench/tws.py [--quick]``.
"""

from __future__ import annotations

import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import (  # noqa: E402
    LoadSampler,
    add_render,
    fmt,
    load_brief,
    parser,
    publish,
    render_stored,
    summary,
    table,
    tree_cpu_s,
)
from bench.spark_job import new_session, write_file  # noqa: E402
from dstl.spark import StatefulProcessor as DstlProcessor  # noqa: E402

GAP_MS = 30_000
DELAY = "10 seconds"
DELAY_MS = 10_000
OUTPUT = "user string, start_ms long, end_ms long, clicks long"
VARIANTS = ("dstl", "spark")


# ----------------------------------------------------------------- the logic, twice


class Sessions(DstlProcessor):
    def init(self, handle: Any) -> None:
        self.handle = handle
        self.session = handle.get_value_state("session")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: Any) -> Iterator[dict[str, Any]]:
        s = self.session.get()
        if s is not None and s[1] + GAP_MS <= timer_values.current_watermark_ms:
            self.handle.delete_timer(s[1] + GAP_MS)  # closed already (Spark's order)
            yield {"user": key, "start_ms": s[0], "end_ms": s[1], "clicks": s[2]}
            s = None
        ts = [r["ts_ms"] for r in rows]
        start, end = min(ts), max(ts)
        if s is not None:
            start, end = min(start, s[0]), max(end, s[1])
            if end != s[1]:
                self.handle.delete_timer(s[1] + GAP_MS)
        self.handle.register_timer(end + GAP_MS)
        self.session.update((start, end, (s[2] if s else 0) + len(ts)))

    def handle_expired_timer(self, key: Any, timer_values: Any, expired_timer_info: Any
                             ) -> Iterator[dict[str, Any]]:
        s = self.session.get()
        self.session.clear()
        yield {"user": key, "start_ms": s[0], "end_ms": s[1], "clicks": s[2]}


def _spark_processor() -> Any:
    """Spark's version (a class made on demand: pyspark's base class imports Spark)."""
    from pyspark.sql.streaming.stateful_processor import StatefulProcessor

    class SparkSessions(StatefulProcessor):  # type: ignore[misc]
        def init(self, handle: Any) -> None:
            self.handle = handle
            self.session = handle.getValueState("session",
                                                "start_ms long, end_ms long, clicks long")

        def _out(self, key: Any, s: Any) -> Any:
            import pandas as pd

            return pd.DataFrame({"user": [key[0]], "start_ms": [int(s[0])],
                                 "end_ms": [int(s[1])], "clicks": [int(s[2])]})

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
            s = self.session.get() if self.session.exists() else None
            if s is not None and s[1] + GAP_MS <= timerValues.getCurrentWatermarkInMs():
                self.handle.deleteTimer(int(s[1]) + GAP_MS)
                yield self._out(key, s)
                s = None
            ts = [int(t) for pdf in rows for t in pdf["ts_ms"]]
            start, end = min(ts), max(ts)
            if s is not None:
                start, end = min(start, int(s[0])), max(end, int(s[1]))
                if end != s[1]:
                    self.handle.deleteTimer(int(s[1]) + GAP_MS)
            self.handle.registerTimer(end + GAP_MS)
            self.session.update((start, end, (int(s[2]) if s is not None else 0) + len(ts)))

        def handleExpiredTimer(self, key: Any, timerValues: Any,
                               expiredTimerInfo: Any) -> Any:
            s = self.session.get()
            self.session.clear()
            yield self._out(key, s)

        def close(self) -> None:
            """Nothing to release: the session state is Spark's."""

    return SparkSessions()


# ----------------------------------------------------------------- workload


def make_files(n: int, per_file: int, users: int, seed: int) -> list[list[dict[str, Any]]]:
    import random

    rng = random.Random(seed)
    clock, out = 1_700_000_000_000, []
    for b in range(n):
        rows = []
        for _ in range(per_file):
            clock += rng.choice((100, 200, 400))
            t = clock + rng.randrange(-DELAY_MS // 4, 1)
            rows.append({"user": f"u{rng.randrange(users)}",
                         "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t // 1000))
                         + f".{t % 1000:03d}Z"})
        out.append(rows)
        if b % 3 == 2:
            clock += GAP_MS + 2 * DELAY_MS
    return out


def run_phase(variant: str, phase: int, work: Path, partitions: int,
              sessions: set[tuple[Any, ...]]) -> dict[str, Any]:
    mod: Any = importlib.import_module("bench.tws")
    t0 = time.monotonic()
    spark = new_session(f"bench-tws-{variant}-{phase}", partitions)
    spark.conf.set("spark.sql.streaming.noDataMicroBatches.enabled", "false")
    session_s = time.monotonic() - t0

    cpu: dict[int, float] = {}

    def deliver(df: Any, batch_id: int) -> None:
        sessions.update(tuple(r) for r in df.collect())
        cpu[batch_id] = tree_cpu_s()

    op: Any = None
    try:
        from pyspark.sql import functions as F

        stream = (spark.readStream.schema("user string, ts timestamp")
                  .option("maxFilesPerTrigger", 1).json(str(work / "src"))
                  .withColumn("ts_ms", F.expr("unix_millis(ts)")))
        if variant == "spark":
            writer = (stream.withWatermark("ts", DELAY).groupBy("user")
                      .transformWithStateInPandas(mod._spark_processor(), OUTPUT, "Append",
                                                  "EventTime")
                      .writeStream.outputMode("append").foreachBatch(deliver))
        else:
            from dstl.spark import DstlStatefulOperator

            op = DstlStatefulOperator(
                name="sessions", processor=mod.Sessions, key_column="user",
                output_schema=OUTPUT, state_uri=str(work / "state"), partitions=partitions,
                max_parallelism=128, table="lmdb", sink=deliver,
                local_dir=str(work / f"local-{phase}"), time_mode="event_time",
                event_time_column="ts", watermark_delay=DELAY)
            writer = stream.writeStream.foreachBatch(op.foreach_batch)
        q = writer.option("checkpointLocation", str(work / "ck")).trigger(availableNow=True).start()
        q.awaitTermination()
        if q.exception() is not None:
            raise RuntimeError(f"{variant} run {phase} failed: {q.exception()}")
        progress = [json.loads(p.json) for p in q.recentProgress]
    finally:
        if op is not None:
            op.close()
        spark.stop()
    batches = [{"batch_id": int(p["batchId"]),
                "trigger_s": p.get("durationMs", {}).get("triggerExecution", 0) / 1e3,
                "cpu_s": (cpu[int(p["batchId"])] - cpu[int(p["batchId"]) - 1]
                          if int(p["batchId"]) - 1 in cpu and int(p["batchId"]) in cpu
                          else None)}
               for p in progress if p.get("numInputRows", 0) > 0]
    return {"session_s": session_s, "batches": sorted(batches, key=lambda b: b["batch_id"])}


def run_variant(variant: str, files: list[list[dict[str, Any]]], n1: int, partitions: int,
                base: Path) -> dict[str, Any]:
    work = base / variant
    (work / "src").mkdir(parents=True)
    sessions: set[tuple[Any, ...]] = set()
    for i in range(n1):
        write_file(work / "src", i, files[i])
    run1 = run_phase(variant, 1, work, partitions, sessions)
    for i in range(n1, len(files)):
        write_file(work / "src", i, files[i])
    run2 = run_phase(variant, 2, work, partitions, sessions)
    shutil.rmtree(work, ignore_errors=True)
    return {"run1": run1, "run2": run2, "sessions": sorted(sessions)}


def figures(results: list[dict[str, Any]]) -> dict[str, Any]:
    steady = [statistics.median([b["trigger_s"] for b in r["run1"]["batches"][1:]
                                 + r["run2"]["batches"][1:]]) for r in results]
    steady_cpu = [statistics.median([b["cpu_s"] for b in r["run1"]["batches"][1:]
                                     + r["run2"]["batches"][1:] if b["cpu_s"] is not None])
                  for r in results]
    return {"trigger_s": summary(steady), "cpu_s": summary(steady_cpu),
            "restart_trigger_s": summary([r["run2"]["batches"][0]["trigger_s"]
                                          for r in results]),
            "first_trigger_s": summary([r["run1"]["batches"][0]["trigger_s"] for r in results]),
            "sessions": len(results[0]["sessions"])}


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--batches", type=int, default=None)
    p.add_argument("--restart-batches", type=int, default=None)
    p.add_argument("--events", type=int, default=2000, help="clicks per micro-batch")
    p.add_argument("--users", type=int, default=400)
    p.add_argument("--partitions", type=int, default=2)
    add_render(p)
    args = p.parse_args()
    if args.render:
        render_stored("tws", Path(args.render), markdown)
        return
    q = args.quick
    n1, k = args.batches or (4 if q else 9), args.restart_batches or (3 if q else 4)
    events = 300 if q and "--events" not in sys.argv else args.events
    repeats = 1 if q and "--repeats" not in sys.argv else args.repeats
    t0 = time.monotonic()
    load = LoadSampler()
    base = Path(tempfile.mkdtemp(prefix="dstl-bench-tws-"))
    raw: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    equal = True
    try:
        for rep in range(repeats):
            files = make_files(n1 + k, events, args.users, seed=15 + rep)
            for v in VARIANTS[rep % 2:] + VARIANTS[:rep % 2]:
                t = time.monotonic()
                raw[v].append(run_variant(v, files, n1, args.partitions, base / f"r{rep}"))
                print(f"repeat {rep + 1}/{repeats} {v:>5}: {time.monotonic() - t:5.1f}s, "
                      f"{len(raw[v][-1]['sessions'])} sessions", flush=True)
            equal &= raw["dstl"][-1]["sessions"] == raw["spark"][-1]["sessions"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    load.stop()
    figs = {v: figures(raw[v]) for v in VARIANTS}
    publish("tws", {"config": vars(args) | {"batches": n1, "restart_batches": k,
                                            "events": events, "repeats": repeats},
                    "summary": figs, "equal": equal, "load": load.summary,
                    "total_s": time.monotonic() - t0,
                    "raw": {v: [{kk: r[kk] for kk in ("run1", "run2")} for r in raw[v]]
                            for v in VARIANTS}},
            markdown, quick=q, command=f"python bench/tws.py{' --quick' if q else ''}",
            no_doc=args.no_doc)
    if not equal:
        sys.exit("the two variants emitted different sessions")


def markdown(figures: dict[str, Any]) -> str:
    """The docs section of a run, from its stored figures."""
    c, d, s = figures["config"], figures["summary"]["dstl"], figures["summary"]["spark"]

    def row(label: str, key: str, goal: float | None = None) -> list[str]:
        r = d[key]["median"] / s[key]["median"]
        return [label, fmt(d[key], scale=1e3, digits=0), fmt(s[key], scale=1e3, digits=0),
                f"{r:.2f}x", "—" if goal is None else
                f"<= {goal}x: " + ("met" if r <= goal else "**missed**")]

    return "\n".join([
        table(["figure", "DSTL operator (LMDB, agent)",
               "Spark `transformWithStateInPandas` (same run)", "DSTL / Spark", "goal"],
              [row("steady batch `triggerExecution` (ms)", "trigger_s", 0.5),
               row("steady batch CPU, whole process tree (ms)", "cpu_s"),
               row("**restart**: first batch `triggerExecution` (ms)", "restart_trigger_s"),
               row("first batch of the query (ms)", "first_trigger_s")]), "",
        f"Sessions with event-time timers: {c['batches']} + {c['restart_batches']} micro-batches "
        f"(a restart between) of {c['events']:,} clicks, P = {c['partitions']}, `local[2]`, "
        f"median (min..max) over {c['repeats']} repeats; sessions equal in both: "
        f"{'yes' if figures['equal'] else '**no**'}; {load_brief(figures.get('load'))}.",
    ])


if __name__ == "__main__":
    main()
