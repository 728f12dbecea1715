"""Timers under Spark against a model (capabilities 1-3): processing-time timers
fire exactly once in the committed history across a killed task (Spark retries it), a batch
re-run, a rescale (partitions changed) and batches without input; every partition fires its due
timers with no rows. Heap and LMDB, executor agent on and off. The event-time side (watermark,
late rows, a restart in a fresh SparkSession) is test_spark_watermark.py. The runnable
sessionization and window examples (examples/*.py) run here at full size, on this module's
session, against their plain-Python definitions, which share no code with their processors;
each asserts that its input has every case the definition is about."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spark_support import load_example, spark  # noqa: F401

from dstl.errors import ConfigError, UsageError
from dstl.spark import DstlStatefulOperator, ExpiredTimerInfo, StatefulProcessor, TimerValues

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

SCHEMA = "key string, op string, at long"
OUT = "key string, at long, now long, seen long, left long"


class Remind(StatefulProcessor):
    """Each row sets (``op="set"``) or deletes (``"del"``) a processing-time timer of its key at
    ``at``; a fired timer is output with the batch's time, the key's row count (its state is in
    scope) and how many timers the key has left. ``flag`` (set on a subclass made per test):
    the first attempt of partition 1 that fires a timer kills its worker."""

    flag = ""

    def init(self, handle: Any) -> None:
        self.handle = handle
        self.seen = handle.get_value_state("seen")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]],
                          timer_values: TimerValues) -> Iterator[dict[str, Any]]:
        assert timer_values.current_watermark_ms == -1  # no watermark configured
        n = self.seen.get() or 0
        for r in rows:
            n += 1
            if r["op"] == "set":
                self.handle.register_timer(r["at"])
            else:
                self.handle.delete_timer(r["at"])
        self.seen.update(n)
        return iter(())

    def handle_expired_timer(self, key: Any, timer_values: TimerValues,
                             expired_timer_info: ExpiredTimerInfo) -> Iterator[dict[str, Any]]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if self.flag and ctx is not None and ctx.partitionId() == 1 \
                and ctx.attemptNumber() == 0 and not os.path.exists(self.flag):
            Path(self.flag).write_text("crashed")
            os._exit(137)
        yield {"key": key, "at": expired_timer_info.get_expiry_time_in_ms(),
               "now": timer_values.getCurrentProcessingTimeInMs(), "seen": self.seen.get(),
               "left": len(self.handle.list_timers())}


class Model:
    """The timers that should exist, and what each batch should fire."""

    def __init__(self) -> None:
        self.timers: set[tuple[str, int]] = set()
        self.seen: dict[str, int] = {}

    def fire(self, now: int) -> list[tuple[str, int, int, int, int]]:
        """What a batch at ``now`` fires (before its rows): each timer with the key's timers
        left once it is consumed (its later due ones included: they fire after it)."""
        due = sorted(t for t in self.timers if t[1] <= now)
        out = sorted((k, at, now, self.seen[k],
                      sum(1 for kk, a in self.timers if kk == k and a > at)) for k, at in due)
        self.timers -= set(due)
        return out

    def apply(self, rows: list[tuple[str, str, int]]) -> None:
        for key, op, at in rows:
            self.seen[key] = self.seen.get(key, 0) + 1
            (self.timers.add if op == "set" else self.timers.discard)((key, at))


def _rows(rng: random.Random, n: int, lo: int, hi: int, model: Model
          ) -> list[tuple[str, str, int]]:
    """``n`` rows, at most one per (key, time) — Spark does not keep the order of a key's rows
    that come from different input partitions; a fifth delete existing timers."""
    keys = [f"k{i}" for i in range(25)]
    existing = sorted(model.timers)
    picked: dict[tuple[str, int], str] = {}
    while len(picked) < n:
        if existing and rng.random() < 0.2:
            picked[rng.choice(existing)] = "del"
        else:
            picked.setdefault((rng.choice(keys), rng.randrange(lo, hi)), "set")
    return [(k, op, at) for (k, at), op in picked.items()]


@pytest.mark.parametrize("table,agent", [("lmdb", True), ("heap", False)])
def test_processing_time_timers_fire_exactly_once(spark: Any, tmp_path: Path, table: str,  # noqa: F811
                                                  agent: bool) -> None:
    remind = type("RemindHere", (Remind,), {"flag": str(tmp_path / "crashed")})
    history: dict[int, list[tuple[Any, ...]]] = {}

    def sink(df: Any, batch_id: int) -> None:  # a re-run replaces the batch's output
        history[batch_id] = sorted(tuple(r) for r in df.collect())

    def op(partitions: int) -> DstlStatefulOperator:
        o = DstlStatefulOperator(name="remind", processor=remind, key_column="key",
                                 output_schema=OUT, state_uri=str(tmp_path / "store"),
                                 partitions=partitions, max_parallelism=16, table=table,
                                 sink=sink, local_dir=str(tmp_path / "local"), agent=agent,
                                 materialization_interval_s=0.0, time_mode="ProcessingTime")
        return o

    rng = random.Random(15)
    model = Model()
    o = op(3)
    expected: dict[int, list[tuple[Any, ...]]] = {}

    def run(o: DstlStatefulOperator, batch_id: int, now: int,
            rows: list[tuple[str, str, int]]) -> None:
        o.clock_ms = lambda: now
        o.foreach_batch(spark.createDataFrame(rows, SCHEMA), batch_id)
        assert history[batch_id] == expected[batch_id], f"batch {batch_id}"
        assert o.batch_stats[-1]["timers_fired"] == len(expected[batch_id])

    # batch 0: timers set; nothing due yet
    rows = _rows(rng, 120, 1_100, 1_600, model)
    expected[0] = model.fire(1_000)
    model.apply(rows)
    run(o, 0, 1_000, rows)
    # batch 1: the timers up to 1200 fire before the batch's rows
    rows = _rows(rng, 60, 1_250, 1_700, model)
    expected[1] = model.fire(1_200)
    model.apply(rows)
    run(o, 1, 1_200, rows)
    # batch 2: no input at all; partition 1's first attempt dies while firing (Spark retries)
    expected[2] = model.fire(1_400)
    after_2 = set(model.timers)
    run(o, 2, 1_400, [])
    assert (tmp_path / "crashed").exists()
    assert expected[2], "the scenario fires timers in batch 2"
    # Spark re-runs batch 2: the same timers fire again, in the re-run only
    run(o, 2, 1_400, [])
    assert model.timers == after_2
    o.close()
    # rescale: 3 -> 2 partitions; the timers move with their keys
    o = op(2)
    rows = _rows(rng, 40, 1_500, 2_000, model)
    expected[3] = model.fire(1_500)
    model.apply(rows)
    run(o, 3, 1_500, rows)
    assert "rescale" in o.batch_stats[-1]["accesses"]
    # batch 4, no input: every timer left fires, in every partition
    expected[4] = model.fire(10_000)
    run(o, 4, 10_000, [])
    assert not model.timers
    fired = [(r[0], r[1]) for b in sorted(history) for r in history[b]]
    assert len(fired) == len(set(fired)), "a timer fired twice in the committed history"
    o.close()


def test_timer_calls_outside_their_place_are_typed_errors(spark: Any, tmp_path: Path  # noqa: F811
                                                          ) -> None:
    class NoMode(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.handle = handle

        def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                              ) -> Iterator[dict[str, Any]]:
            self.handle.register_timer(5)
            return iter(())

    o = DstlStatefulOperator(name="nomode", processor=NoMode, key_column="key",
                             output_schema=OUT, state_uri=str(tmp_path / "s"), partitions=1,
                             max_parallelism=4, table="heap", agent=False)
    with pytest.raises(Exception, match="time_mode is 'none'"):
        o.foreach_batch(spark.createDataFrame([("a", "set", 1)], SCHEMA), 0)
    o.close()


@pytest.mark.parametrize("kwargs,field", [
    ({"time_mode": "wall"}, "time_mode"),
    ({"time_mode": 3}, "time_mode"),
    ({"time_mode": "event_time"}, "time_mode"),
    ({"event_time_column": "ts"}, "watermark_delay"),
    ({"watermark_delay": 5}, "event_time_column"),
    ({"event_time_column": "ts", "watermark_delay": -1}, "watermark_delay"),
    ({"event_time_column": "ts", "watermark_delay": "5 fortnights"}, "watermark_delay"),
    ({"event_time_column": "ts", "watermark_delay": float("nan")}, "watermark_delay"),
    ({"event_time_column": "key", "watermark_delay": 5}, "event_time_column"),
    ({"event_time_column": "_dstl_pid", "watermark_delay": 5}, "event_time_column"),
    ({"late_rows": "keep"}, "late_rows"),
    ({"late_rows": "side_output"}, "late_rows"),
    ({"event_time_column": "ts", "watermark_delay": 5, "late_rows": "side_output",
      "sink": lambda d, b: None}, "late_sink"),
    ({"event_time_column": "ts", "watermark_delay": 5, "late_rows": "side_output",
      "late_column": "seen"}, "late_column"),
    ({"late_column": "late"}, "late_column"),
    ({"event_time_column": "ts", "watermark_delay": 5, "late_sink": lambda d, b: None},
     "late_sink"),
    ({"event_time_column": "ts", "watermark_delay": 5, "late_rows": "side_output",
      "late_sink": lambda d: None}, "late_sink"),
])
def test_time_options_are_checked(kwargs: dict[str, Any], field: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=field) as err:
        DstlStatefulOperator(name="t", processor=Remind, key_column="key", output_schema=OUT,
                             state_uri=str(tmp_path), **kwargs)
    assert err.value.field == field


def test_reserved_state_names_and_timers_outside_a_key(tmp_path: Path) -> None:
    from dstl import ChangelogStorage, DstlOptions, KeyGroupRange
    from dstl.spark.processor import StatefulProcessorHandle
    from materializer.backend import ChangelogKeyedStateBackend

    storage = ChangelogStorage(str(tmp_path), options=DstlOptions(persist_delay_s=0.0))
    b = ChangelogKeyedStateBackend(storage, "op/0", KeyGroupRange(0, 3), 4)
    h = StatefulProcessorHandle(b, "processing_time")
    with pytest.raises(UsageError, match="reserved"):
        h.get_value_state("$timers")
    with pytest.raises(UsageError, match="belong to a key"):
        h.register_timer(5)
    b.close()
    storage.close()


def test_heartbeat_runs_batches_that_fire_timers_without_input(spark: Any,  # noqa: F811
                                                               tmp_path: Path) -> None:
    import json
    import time

    from dstl.spark import with_heartbeat

    src = tmp_path / "src"
    src.mkdir()
    due = int(time.time() * 1000) + 2_500
    keys = [f"k{i}" for i in range(6)]
    (src / "part-0.json").write_text("".join(
        json.dumps({"key": k, "op": "set", "at": due + i}) + "\n" for i, k in enumerate(keys)))
    fired: list[tuple[Any, ...]] = []
    o = DstlStatefulOperator(name="beat", processor=Remind, key_column="key",
                             output_schema=OUT, state_uri=str(tmp_path / "store"),
                             partitions=3, max_parallelism=16, table="heap", agent=False,
                             local_dir=str(tmp_path / "local"), time_mode="processing_time",
                             sink=lambda df, b: fired.extend(tuple(r) for r in df.collect()))
    stream = with_heartbeat(spark.readStream.schema(SCHEMA).json(str(src)))
    q = (stream.writeStream.foreachBatch(o.foreach_batch)
         .option("checkpointLocation", str(tmp_path / "ck"))
         .trigger(processingTime="1 second").start())
    try:
        deadline = time.monotonic() + 90
        while len(fired) < len(keys) and time.monotonic() < deadline and q.isActive:
            time.sleep(0.5)
    finally:
        q.stop()
        o.close()
    assert q.exception() is None
    assert sorted((r[0], r[1]) for r in fired) == [(k, due + i) for i, k in enumerate(keys)]
    assert all(r[2] >= r[1] for r in fired)  # fired at a processing time at or after it
    quiet = [s for s in o.batch_stats if s["rows_in"] == 0]
    assert quiet and any(s["timers_fired"] for s in quiet), "fired by a heartbeat-only batch"
    with pytest.raises(ConfigError, match="rows_per_second"):
        with_heartbeat(stream, rows_per_second=0)
    with pytest.raises(ConfigError, match="once"):
        with_heartbeat(stream)


@pytest.mark.parametrize("table,restart_after", [
    ("lmdb", 7),
    pytest.param("heap", None, marks=pytest.mark.skipif(
        not os.environ.get("DSTL_DEEP"), reason="DSTL_DEEP=1: the heap table without a restart "
                                                "(CI runs the full size on LMDB with one)")),
])
def test_sessionization_at_full_size_equals_the_definition(
        spark: Any, tmp_path: Path, table: str, restart_after: int | None) -> None:  # noqa: F811
    ex = load_example("sessionization")
    r = ex.run(spark, tmp_path, table=table, agent=table == "lmdb", restart_after=restart_after)
    cases = r["cases"]
    print(f"sessionization input cases: {cases}")
    assert all(cases.values()), f"a case the input must have is missing: {cases}"
    want, closed_by = r["expected"]
    assert len(want) > 300, "the full-size run closes sessions"
    assert sorted(r["sessions"]) == sorted(want)  # each exactly once
    assert len(r["late"]) == cases["late"]
    on_time = [0] * len(r["batches"])
    for _, _, b in ex.on_time_clicks(r["batches"]):
        on_time[b] += 1
    # every click received (Spark's numInputRows), of which the late ones were dropped
    assert [s["rows_in"] for s in r["stats"]] == [len(b) for b in r["batches"]]
    assert [s["rows_in"] - s["rows_late"] for s in r["stats"]] == on_time
    assert r["stats"][-1]["watermark_ms"] == closed_by


def test_window_count_at_full_size_equals_the_definition(spark: Any,  # noqa: F811
                                                         tmp_path: Path) -> None:
    ex = load_example("window_count")
    r = ex.run(spark, tmp_path, table="lmdb", agent=True, idle_s=2.0)
    cases = r["cases"]
    print(f"window_count input cases: {cases}")
    assert all(cases.values()), f"a case the input must have is missing: {cases}"
    assert r["expected"] and sorted(r["windows"]) == sorted(r["expected"])  # each once
    wm = ex.watermarks(r["batches"])
    files = [s for s in r["stats"] if s["rows_in"] > 0]
    assert [s["rows_in"] for s in files] == [len(rows) for rows in r["batches"]]
    assert [s["rows_in"] - s["rows_late"] for s in files] == [
        sum(v["ts_ms"] > wm[b] for v in rows) for b, rows in enumerate(r["batches"])]
    assert ex.heartbeat_cost(r["stats"])["batches"] > 0
