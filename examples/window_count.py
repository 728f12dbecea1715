"""A tumbling-window count fired by the watermark (docs/spark.md, "Timers and watermarks").

Page views are counted per page and ``WINDOW_MS`` window of event time in a map state (window
end -> count). The first view of a window registers an event-time timer at ``end - 1``; when the
watermark reaches it, no on-time view can fall into the window any more, so
``handle_expired_timer`` emits the window's count once and removes it. Views at or below the
watermark are late and dropped (``late_rows="drop"``, the default).

The input is a file source fed one file per micro-batch, unioned with a heartbeat
(``with_heartbeat``) and run with a processing-time trigger, as a job on a quiet stream would
run: heartbeat-only batches still run every partition's task (they fire processing-time timers;
event-time ones wait for the watermark, which only event rows move). Run it::

    python examples/window_count.py [--quick] [--table heap|lmdb]

It checks the emitted windows against :func:`expected_windows`, a plain-Python definition
(which views are on time, then their count per page and window, and which windows the final
watermark completed), counts in the input the cases that matter (:func:`input_cases`), and
prints the windows and the cost of the heartbeat-only batches.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _harness import main, write_files

from dstl.spark import (
    DstlStatefulOperator,
    ExpiredTimerInfo,
    StatefulProcessor,
    TimerValues,
    with_heartbeat,
)

WINDOW_MS = 10_000
DELAY_MS = 5_000
OUTPUT = "page string, window_start long, views long"


class WindowCount(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.handle = handle
        self.counts = handle.get_map_state("counts")  # window end -> views

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: TimerValues) -> Iterator[dict[str, Any]]:
        for row in rows:
            end = row["ts_ms"] // WINDOW_MS * WINDOW_MS + WINDOW_MS
            n = self.counts.get(end)
            if n is None:
                self.handle.register_timer(end - 1)
            self.counts.put(end, (n or 0) + 1)
        return iter(())

    def handle_expired_timer(self, key: Any, timer_values: TimerValues,
                             expired_timer_info: ExpiredTimerInfo) -> Iterator[dict[str, Any]]:
        end = expired_timer_info.expiry_time_ms + 1
        views = self.counts.get(end)
        self.counts.remove(end)
        yield {"page": key, "window_start": end - WINDOW_MS, "views": views}


def make_batches(rng: random.Random, batches: int, per_batch: int) -> list[list[dict[str, Any]]]:
    """Views of 6 pages; event time moves ~2 s per batch, jittered by up to 3 s; a few
    views from long ago (late). Into the batches whose event times span a window boundary,
    views at the last millisecond of one window and the first of the next are added; into a
    few, a view exactly at the watermark the batch applies (late) and one 1 ms above it (on
    time) (:func:`watermarks`)."""
    out = []
    for b in range(batches):
        rows = []
        for _ in range(per_batch):
            t = 1_000_000 + b * 2_000 + rng.randrange(-3_000, 1)
            if rng.random() < 0.03:
                t -= 60_000
            rows.append({"page": f"/p{rng.randrange(6)}", "ts_ms": t})
        edge = (1_000_000 + b * 2_000) // WINDOW_MS * WINDOW_MS
        if edge > 1_000_000 + b * 2_000 - 3_000:
            rows += [{"page": f"/p{rng.randrange(6)}", "ts_ms": t} for t in (edge - 1, edge)]
        out.append(rows)
    for b in range(1, batches, 3):
        wm = watermarks(out)[b]
        out[b] += [{"page": f"/p{rng.randrange(6)}", "ts_ms": t} for t in (wm, wm + 1)]
    return out


def watermarks(batches: list[list[dict[str, Any]]]) -> list[int]:
    """The watermark each file's batch applies, and last the one after the last file (Spark's
    rule, docs/spark.md "Watermark"; ``dstl/spark/timing.py``): 0 for the first batch; after a
    batch, ``max(watermark, largest event time of its rows - DELAY_MS)``. Heartbeat-only
    batches carry no event time and leave it as it is; whether late rows count does not
    matter (a late row minus the delay is below the watermark)."""
    wm = [0]
    for rows in batches:
        wm.append(max([wm[-1], *(r["ts_ms"] - DELAY_MS for r in rows)]))
    return wm


def expected_windows(batches: list[list[dict[str, Any]]]) -> set[tuple[Any, ...]]:
    """The windows the query must emit, by definition: the on-time views (above the watermark
    their batch applies; :func:`watermarks`) counted per page and window ``[start, start +
    WINDOW_MS)``; of those, the windows whose last millisecond is at or below the watermark
    after the last file, which the heartbeat-only batches after it apply (every later on-time
    view is after the window)."""
    wm = watermarks(batches)
    counts: dict[tuple[str, int], int] = {}
    for b, rows in enumerate(batches):
        for r in rows:
            if r["ts_ms"] > wm[b]:
                key = (r["page"], r["ts_ms"] - r["ts_ms"] % WINDOW_MS)
                counts[key] = counts.get(key, 0) + 1
    return {(page, start, n) for (page, start), n in counts.items()
            if start + WINDOW_MS - 1 <= wm[-1]}


def input_cases(batches: list[list[dict[str, Any]]]) -> dict[str, int]:
    """How often the input has each case the processor must get right: late views
    (``late``), exactly at the watermark (``late_at_watermark``), 1 ms above it
    (``on_time_at_watermark_plus_1``); on-time views at a window's first and last millisecond
    (``window_first_ms``, ``window_last_ms``); on-time views below the largest event time of an
    earlier batch (``out_of_order_across_batches``); emitted windows whose views came in
    several batches (``window_from_several_batches``)."""
    wm = watermarks(batches)
    cases = dict.fromkeys(("late", "late_at_watermark", "on_time_at_watermark_plus_1",
                           "window_first_ms", "window_last_ms", "out_of_order_across_batches",
                           "window_from_several_batches"), 0)
    seen = 0
    batches_of: dict[tuple[str, int], set[int]] = {}
    for b, rows in enumerate(batches):
        for r in rows:
            t = r["ts_ms"]
            if t <= wm[b]:
                cases["late"] += 1
                cases["late_at_watermark"] += t == wm[b]
                continue
            cases["on_time_at_watermark_plus_1"] += t == wm[b] + 1
            cases["window_first_ms"] += t % WINDOW_MS == 0
            cases["window_last_ms"] += t % WINDOW_MS == WINDOW_MS - 1
            cases["out_of_order_across_batches"] += t < seen
            batches_of.setdefault((r["page"], t - t % WINDOW_MS), set()).add(b)
        seen = max([seen, *(r["ts_ms"] for r in rows)])
    cases["window_from_several_batches"] = sum(
        len(batches_of[(page, start)]) > 1 for page, start, _ in expected_windows(batches))
    return cases


def run(spark: Any, workdir: Path, *, quick: bool = False, table: str = "lmdb",
        agent: bool = True, idle_s: float = 6.0) -> dict[str, Any]:
    """Run the query until every file is read and a heartbeat-only batch after the last file
    (it applies the final watermark) has run, and for at least ``idle_s`` seconds on heartbeats
    only; returns the windows (a list: a window emitted twice shows), the input, the expected
    windows, the input's cases and the batch stats."""
    batches = make_batches(random.Random(15), 5 if quick else 12, 40 if quick else 300)
    src = workdir / "src"
    write_files(src, batches)
    windows: list[tuple[Any, ...]] = []
    op = DstlStatefulOperator(
        name="windows", processor=WindowCount, key_column="page", output_schema=OUTPUT,
        state_uri=str(workdir / "state"), partitions=2, max_parallelism=32, table=table,
        agent=agent, local_dir=str(workdir / "local"), time_mode="event_time",
        event_time_column="ts_ms", watermark_delay=DELAY_MS / 1000,
        sink=lambda df, b: windows.extend(tuple(r) for r in df.collect()))
    stream = with_heartbeat(spark.readStream.schema("page string, ts_ms long")
                            .option("maxFilesPerTrigger", 1).json(str(src)))
    q = (stream.writeStream.foreachBatch(op.foreach_batch)
         .option("checkpointLocation", str(workdir / "checkpoint"))
         .trigger(processingTime="1 second").start())
    try:
        deadline = time.monotonic() + 300
        files_read = None
        while files_read is None or time.monotonic() < files_read + idle_s \
                or not _heartbeat_after_files(op.batch_stats, len(batches)):
            if not q.isActive or time.monotonic() > deadline:
                raise RuntimeError(f"the query stopped or stalled: {q.exception()}")
            if files_read is None and sum(s["rows_in"] > 0 for s in op.batch_stats) \
                    >= len(batches):
                files_read = time.monotonic()
            time.sleep(0.5)
    finally:
        q.stop()
        op.close()
    return {"windows": windows, "batches": batches, "expected": expected_windows(batches),
            "cases": input_cases(batches), "stats": list(op.batch_stats)}


def _heartbeat_after_files(stats: list[dict[str, Any]], files: int) -> bool:
    """A batch without input rows ran after the ``files``-th batch with rows."""
    with_rows = [i for i, s in enumerate(stats) if s["rows_in"] > 0]
    return len(with_rows) >= files and any(s["rows_in"] == 0
                                           for s in stats[with_rows[files - 1] + 1:])


def heartbeat_cost(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Per heartbeat-only batch (no input rows): median seconds, objects and bytes written."""
    quiet = [s for s in stats if s["rows_in"] == 0]
    if not quiet:
        return {"batches": 0}
    return {"batches": len(quiet),
            "seconds_median": statistics.median(s["batch_seconds"] for s in quiet),
            "seconds_max": max(s["batch_seconds"] for s in quiet),
            "objects_median": statistics.median(s["objects_written"] for s in quiet),
            "bytes_median": statistics.median(s["bytes_written"] for s in quiet)}


def report(r: dict[str, Any]) -> int:
    print("input: " + ", ".join(f"{k} {v}" for k, v in r["cases"].items()))
    for page, start, views in sorted(r["windows"], key=lambda w: (w[1], w[0])):
        print(f"{page:>4}  [{start}, {start + WINDOW_MS})  {views:>5} views")
    print(f"{len(r['windows'])} windows in {len(r['stats'])} batches; heartbeat-only batches: "
          f"{json.dumps(heartbeat_cost(r['stats']))}")
    if len(r["windows"]) != len(set(r["windows"])) or set(r["windows"]) != r["expected"]:
        print(f"MISMATCH: expected {len(r['expected'])} windows", file=sys.stderr)
        return 1
    print("equal to the definition")
    return 0


if __name__ == "__main__":
    sys.exit(main(__doc__, "dstl-window-count", run, report))
