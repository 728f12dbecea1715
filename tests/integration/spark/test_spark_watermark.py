"""Event time under Spark against a model (capability 3): the watermark is the largest
event time of earlier batches minus the delay, never decreasing, committed with each checkpoint
and continued after a restart in a fresh SparkSession (here also with other partitions: a
rescale); late rows go to the side output; event-time timers (a tumbling window per key) fire
when the watermark passes them, exactly once in the committed history (a re-run batch fires
again only in the re-run)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spark_support import new_session

from dstl.spark import DstlStatefulOperator, ExpiredTimerInfo, StatefulProcessor, TimerValues

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

WINDOW = 1_000
DELAY = 1_500
SCHEMA = "key string, et long, n long"
OUT = "key string, window_end long, count long, wm long"


class WindowCount(StatefulProcessor):
    """Rows per key and tumbling window of event time; a window is output once the watermark
    passes its end (an event-time timer at ``end - 1``)."""

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.counts = handle.get_map_state("counts")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: TimerValues) -> Iterator[dict[str, Any]]:
        wm = timer_values.current_watermark_ms
        for r in rows:
            assert r["et"] > wm, "a late row reached the processor"
            assert "_dstl_event_ms" not in r
            end = r["et"] // WINDOW * WINDOW + WINDOW
            c = self.counts.get(end)
            if c is None:
                self.handle.register_timer(end - 1)
            self.counts.put(end, (c or 0) + 1)
        return iter(())

    def handle_expired_timer(self, key: Any, timer_values: TimerValues,
                             expired_timer_info: ExpiredTimerInfo) -> Iterator[dict[str, Any]]:
        end = expired_timer_info.expiry_time_ms + 1
        assert end - 1 <= timer_values.current_watermark_ms
        c = self.counts.get(end)
        self.counts.remove(end)
        yield {"key": key, "window_end": end, "count": c,
               "wm": timer_values.current_watermark_ms}


class Model:
    def __init__(self) -> None:
        self.wm = 0
        self.counts: dict[tuple[str, int], int] = {}

    def batch(self, rows: list[tuple[str, int, int]]
              ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], int]:
        """(fired windows, late rows) of a batch, and the batch's watermark."""
        wm = self.wm
        fired = sorted((k, end, c, wm) for (k, end), c in self.counts.items() if end - 1 <= wm)
        for k, end, _, _ in fired:
            del self.counts[(k, end)]
        late = sorted(r for r in rows if r[1] <= wm)
        on_time = [r for r in rows if r[1] > wm]
        for k, et, _ in on_time:
            end = et // WINDOW * WINDOW + WINDOW
            self.counts[(k, end)] = self.counts.get((k, end), 0) + 1
        if on_time:
            self.wm = max(wm, max(r[1] for r in on_time) - DELAY)
        return fired, late, wm


def _rows(rng: random.Random, n: int, start: int, lo: int, hi: int) -> list[tuple[str, int, int]]:
    return [(f"u{rng.randrange(12)}", rng.randrange(lo, hi), start + i) for i in range(n)]


def _session_run(tmp: Path, partitions: int, table: str, agent: bool, batches: list[Any],
                 model: Model, first_batch: int, rerun_last: bool = False) -> list[int]:
    """Run ``batches`` in a fresh SparkSession; check each against the model; the committed
    watermarks."""
    spark = new_session("dstl-watermark")
    out: dict[int, list[tuple[Any, ...]]] = {}
    late: dict[int, list[tuple[Any, ...]]] = {}
    op = DstlStatefulOperator(
        name="windows", processor=WindowCount, key_column="key", output_schema=OUT,
        state_uri=str(tmp / "store"), partitions=partitions, max_parallelism=16, table=table,
        agent=agent, local_dir=str(tmp / f"local-{first_batch}"),
        materialization_interval_s=0.0, time_mode="EventTime", event_time_column="et",
        watermark_delay=f"{DELAY} ms", late_rows="side_output",
        sink=lambda df, b: out.__setitem__(b, sorted(tuple(r) for r in df.collect())),
        late_sink=lambda df, b: late.__setitem__(b, sorted(tuple(r) for r in df.collect())))
    try:
        for i, rows in enumerate(batches):
            b = first_batch + i
            fired, late_rows, wm = model.batch(rows)
            for attempt in range(2 if rerun_last and i == len(batches) - 1 else 1):
                op.foreach_batch(spark.createDataFrame(rows, SCHEMA), b)
                assert out[b] == fired, f"batch {b} attempt {attempt}: windows"
                assert late[b] == late_rows, f"batch {b}: late rows"
                assert op.batch_stats[-1]["watermark_ms"] == wm
                assert op.batch_stats[-1]["next_watermark_ms"] == model.wm
                # rows received, the late ones included (Spark's numInputRows)
                progress = op.last_progress or {}
                assert progress["numInputRows"] == len(rows), f"batch {b}: rows in"
                assert progress["stateOperators"][0]["customMetrics"]["lateRows"] == \
                    len(late_rows), f"batch {b}: late rows counted"
        coordinator = op.coordinator
        assert coordinator is not None
        return [m.properties["watermark_ms"] for m in coordinator.manifests()]
    finally:
        op.close()
        spark.stop()


@pytest.mark.parametrize("table,agent", [
    ("heap", True),
    pytest.param("lmdb", False, marks=pytest.mark.skipif(
        not os.environ.get("DSTL_DEEP"), reason="DSTL_DEEP=1: the other table and agent mode")),
])
def test_watermark_late_rows_and_event_time_timers_across_a_restart(
        tmp_path: Path, table: str, agent: bool) -> None:
    rng = random.Random(3)
    model = Model()
    first = [_rows(rng, 50, 0, 1_000, 4_000), _rows(rng, 50, 100, 2_000, 6_000),
             _rows(rng, 40, 200, 4_000, 8_000)]
    wms = _session_run(tmp_path, 3, table, agent, first, model, 0, rerun_last=True)
    assert wms == sorted(wms) and wms[-1] == model.wm > 0
    # restart in a fresh session with 2 partitions: the watermark continues from the manifest
    second = [_rows(rng, 40, 300, 5_000, 9_000), [], _rows(rng, 30, 400, 9_000, 20_000),
              [("u0", 30_000, 999)]]
    wms2 = _session_run(tmp_path, 2, table, agent, second, model, 3)
    assert wms2 == sorted(wms2) and wms2[0] >= wms[-1]
    assert model.counts, "some windows are still open (the model's last watermark)"
