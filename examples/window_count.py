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

It checks the emitted windows against a plain-Python computation with the same rules, and
prints them and the cost of the heartbeat-only batches.
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
    views from long ago (late)."""
    out = []
    for b in range(batches):
        rows = []
        for _ in range(per_batch):
            t = 1_000_000 + b * 2_000 + rng.randrange(-3_000, 1)
            if rng.random() < 0.03:
                t -= 60_000
            rows.append({"page": f"/p{rng.randrange(6)}", "ts_ms": t})
        out.append(rows)
    return out


def expected_windows(batches: list[list[dict[str, Any]]]) -> set[tuple[Any, ...]]:
    """The windows the operator must emit (its rules, docs/spark.md): at a batch's start,
    windows whose ``end - 1`` the watermark reached fire; the batch's rows above the watermark
    count; the watermark moves to ``max(event time) - delay``. Heartbeat batches after the
    last file fire what the final watermark reached."""
    counts: dict[tuple[str, int], int] = {}
    fired: set[tuple[Any, ...]] = set()
    wm = 0
    for rows in [*batches, []]:
        for (page, end), n in sorted(counts.items()):
            if end - 1 <= wm:
                fired.add((page, end - WINDOW_MS, n))
                del counts[(page, end)]
        ok = [r for r in rows if r["ts_ms"] > wm]
        for r in ok:
            k = (r["page"], r["ts_ms"] // WINDOW_MS * WINDOW_MS + WINDOW_MS)
            counts[k] = counts.get(k, 0) + 1
        if ok:
            wm = max(wm, max(r["ts_ms"] for r in ok) - DELAY_MS)
    return fired


def run(spark: Any, workdir: Path, *, quick: bool = False, table: str = "lmdb",
        agent: bool = True, idle_s: float = 6.0) -> dict[str, Any]:
    """Run the query until every file is read, then ``idle_s`` more seconds on heartbeats only;
    returns the windows, the expected ones and the batch stats."""
    batches = make_batches(random.Random(15), 5 if quick else 12, 40 if quick else 300)
    src = workdir / "src"
    write_files(src, batches)
    windows: set[tuple[Any, ...]] = set()
    op = DstlStatefulOperator(
        name="windows", processor=WindowCount, key_column="page", output_schema=OUTPUT,
        state_uri=str(workdir / "state"), partitions=2, max_parallelism=32, table=table,
        agent=agent, local_dir=str(workdir / "local"), time_mode="event_time",
        event_time_column="ts_ms", watermark_delay=DELAY_MS / 1000,
        sink=lambda df, b: windows.update(tuple(r) for r in df.collect()))
    stream = with_heartbeat(spark.readStream.schema("page string, ts_ms long")
                            .option("maxFilesPerTrigger", 1).json(str(src)))
    q = (stream.writeStream.foreachBatch(op.foreach_batch)
         .option("checkpointLocation", str(workdir / "checkpoint"))
         .trigger(processingTime="1 second").start())
    try:
        deadline = time.monotonic() + 300
        while sum(s["rows_in"] > 0 for s in op.batch_stats) < len(batches):
            if not q.isActive or time.monotonic() > deadline:
                raise RuntimeError(f"the query stopped or stalled: {q.exception()}")
            time.sleep(0.5)
        time.sleep(idle_s)
    finally:
        q.stop()
        op.close()
    return {"windows": windows, "expected": expected_windows(batches),
            "stats": list(op.batch_stats)}


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
    for page, start, views in sorted(r["windows"], key=lambda w: (w[1], w[0])):
        print(f"{page:>4}  [{start}, {start + WINDOW_MS})  {views:>5} views")
    print(f"{len(r['windows'])} windows in {len(r['stats'])} batches; heartbeat-only batches: "
          f"{json.dumps(heartbeat_cost(r['stats']))}")
    if r["windows"] != r["expected"]:
        print(f"MISMATCH: expected {len(r['expected'])} windows", file=sys.stderr)
        return 1
    print("equal to the batch computation")
    return 0


if __name__ == "__main__":
    sys.exit(main(__doc__, "dstl-window-count", run, report))
