"""The operator inside the user's query (``op.transform(df)``): a streaming DataFrame out, written
by Spark's Parquet file sink, exactly-once against a model computed here from the input files —
with a task whose worker is killed (Spark retries it), across a query restart with a changed
partition count, with two DSTL operators chained in one query, and with the driver SIGKILLed
after Spark's commit and before DSTL's manifest; ``DSTL_DEEP=1`` adds the heap table and
SIGKILLs while the state tasks run, once they are done (before Spark's commit) and after DSTL's
manifest. An ``initial_state`` is applied exactly once (a restart before the first batch, with
another partition count; a restart after; the driver SIGKILLed in the first batch, and with
``DSTL_DEEP=1`` while staging it and around the first batch's commit), and late rows reach the
sink in the output's ``late_row`` column, equal to a watermark model across a restart."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from in_query_driver import SEEDS
from spark_support import spark  # noqa: F401
from support import moto_server
from support.processors import Count, CrashOnce

from dstl.errors import UsageError
from dstl.spark import DstlStatefulOperator, StatefulProcessor

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]

HERE = Path(__file__).resolve().parent
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket
#: CI runs the LMDB table and the crash between Spark's commit and DSTL's manifest (the step
#: only this protocol has); ``DSTL_DEEP=1`` adds the heap and the other two crash points
DEEP = os.environ.get("DSTL_DEEP") == "1"
TABLES = ["lmdb", "heap"] if DEEP else ["lmdb"]
#: (store, table, kill point) of the driver-kill test
KILL_POINTS = [("local", "lmdb", "committed")]
if DEEP:
    KILL_POINTS = [(store, table, kill) for store, table in
                   (("local", "lmdb"), ("local", "heap"), ("s3", "lmdb"))
                   for kill in ("task", "tasks-done", "committed", "manifest")]
#: (store, kill point) of the driver-kill test with an initial state (``DSTL_DEEP=1``: two
#: drivers in turn, 1-5 min each on 2 cores), all in the first batch (batch 0) but ``staging``
#: (the staging job, before the marker). CI runs the initial state across a driver stopped
#: after the staging (test_the_initial_state_is_applied_once_inside_the_query) and the
#: protocol's kill test above.
INITIAL_KILL_POINTS = [("local", kill) for kill in ("staging", "task", "tasks-done", "committed",
                                                    "manifest")] + [("s3", "task")]


class GroupTotal(StatefulProcessor):
    """Per group: how many rows it has received in all, emitted once per batch."""

    def init(self, handle: Any) -> None:
        self.total = handle.get_value_state("total")

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        t = (self.total.get() or 0) + sum(1 for _ in rows)
        self.total.update(t)
        yield {"grp": key, "total": t}


def _file_keys(i: int) -> list[str]:
    """The keys of input file ``i``: 40 rows over 25 keys, shifting with ``i``."""
    return [f"k{(7 * i + j * j) % 25:02d}" for j in range(40)]


def _write_files(work: Path, lo: int, hi: int) -> None:
    (work / "in").mkdir(parents=True, exist_ok=True)
    for i in range(lo, hi):
        tmp = work / f"f{i:03d}.tmp"
        tmp.write_text("".join(json.dumps({"key": k}) + "\n" for k in _file_keys(i)))
        # a file source takes files oldest first: file i is batch i
        os.utime(tmp, (1_700_000_000 + i, 1_700_000_000 + i))
        tmp.rename(work / "in" / f"f{i:03d}.json")  # a file source sees whole files only


def _counts_model(files: int) -> Counter[tuple[int, str, int]]:
    """The rows a per-key running count emits: per file (= batch) and key in it, the number
    of rows of that key in this and every earlier file."""
    seen: Counter[str] = Counter()
    out: Counter[tuple[int, str, int]] = Counter()
    for i in range(files):
        here = Counter(_file_keys(i))
        for k, n in here.items():
            seen[k] += n
            out[(i, k, seen[k])] += 1
    return out


def _seeded_model(files: int) -> tuple[Counter[tuple[str, int]], Counter[str]]:
    """The rows of a per-key running count that starts from the initial state (each seed row's
    ``start`` added to its key), and the counts after ``files`` files."""
    seen: Counter[str] = Counter()
    for k, start in SEEDS:
        seen[k] += start
    out: Counter[tuple[str, int]] = Counter()
    for i in range(files):
        for k, n in Counter(_file_keys(i)).items():
            seen[k] += n
            out[(k, seen[k])] += 1
    return out, seen


def _without_batch(model: Counter[tuple[int, str, int]]) -> Counter[tuple[str, int]]:
    return Counter({(k, c): n for (_, k, c), n in model.items()})


def _read_rows(spark: Any, path: Path, *cols: str) -> Counter[tuple[Any, ...]]:  # noqa: F811
    """The committed rows of a Parquet file sink (read through its ``_spark_metadata``)."""
    return Counter(tuple(r) for r in spark.read.parquet(str(path)).select(*cols).collect())


def _run(spark: Any, op: Any, work: Path, out: Any = None) -> Any:  # noqa: F811
    src = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1)
           .json(str(work / "in")))
    return _run_df(spark, op, (out or (lambda d: d.transform(op)))(src), work)


def _run_df(spark: Any, op: Any, df: Any, work: Path) -> Any:  # noqa: F811
    """``df`` to a Parquet file sink until its input is all read; the query."""
    q = (df.writeStream.format("parquet").option("path", str(work / "out"))
         .option("checkpointLocation", str(work / "cp")).trigger(availableNow=True).start())
    q.awaitTermination()
    assert op.wait_for_checkpoint(int(q.lastProgress["batchId"]))
    return q


def _observed(q: Any, name: str) -> list[dict[str, int]]:
    """The operator's figures in each batch's progress (Spark's observed metrics)."""
    rows = [p["observedMetrics"].get(f"dstl.{name}") for p in q.recentProgress]
    return [r.asDict() if hasattr(r, "asDict") else dict(r) for r in rows if r is not None]


@pytest.mark.parametrize("table", TABLES)
def test_the_file_sink_gets_each_row_once_across_a_restart_and_a_rescale(
        spark: Any, tmp_path: Path, table: str) -> None:  # noqa: F811
    _write_files(tmp_path, 0, 3)
    # the first run's worker is killed in batch 1 (Spark retries the task)
    crash = type("CrashOnceHere", (CrashOnce,), {"flag": str(tmp_path / "killed")})

    def op_of(partitions: int, run: int) -> DstlStatefulOperator:
        return DstlStatefulOperator(name="counts", processor=crash if run == 0 else Count,
                                    key_column="key",
                                    output_schema="key string, count bigint",
                                    state_uri=str(tmp_path / "state"), partitions=partitions,
                                    table=table, local_dir=str(tmp_path / f"local-{run}"),
                                    materialization_interval_s=0)

    op = op_of(4, 0)
    try:
        q = _run(spark, op, tmp_path)
        # DSTL's figures are in Spark's own progress of the query
        seen = _observed(q, "counts")
        assert [m["numInputRows"] for m in seen] == [40] * 3
        assert [m["numOutputRows"] for m in seen] == [len(set(_file_keys(i))) for i in range(3)]
        assert [m["numUpdatedKeys"] for m in seen] == [m["numOutputRows"] for m in seen]
        assert all(m["numStateEntries"] > 0 and m["bytesWritten"] > 0 for m in seen)
        # the state rows, as Spark's numRowsTotal: one count per key seen so far
        assert [m["numRowsTotal"] for m in seen] == [
            len(set().union(*(_file_keys(j) for j in range(i + 1)))) for i in range(3)]
        assert (tmp_path / "killed").exists()
        assert op.last_progress is not None and op.last_progress["batchId"] == 2
        assert [s["batch_id"] for s in op.batch_stats] == [0, 1, 2]
    finally:
        op.close()
    assert _read_rows(spark, tmp_path / "out", "key", "count") == _without_batch(
        _counts_model(3))

    # a new query run on the same checkpoint and state, 3 partitions, an empty local dir
    _write_files(tmp_path, 3, 6)
    op = op_of(3, 1)
    try:
        q = _run(spark, op, tmp_path)
        assert _observed(q, "counts")[0]["numRestores"] == 3  # every partition rescaled
        assert op.coordinator is not None and op.coordinator.latest() is not None
        assert op.coordinator.latest().checkpoint_id == 5
        assert {a for s in op.batch_stats for a in s["accesses"]} >= {"rescale"}
    finally:
        op.close()
    assert _read_rows(spark, tmp_path / "out", "key", "count") == _without_batch(
        _counts_model(6))
    # the protocol's objects of committed batches are gone: only the newest batch's remain
    left = [p for p in (tmp_path / "state" / "query").rglob("*") if p.is_file()]
    assert {p.name[:16] if p.parent.name != f"{5:016x}" else p.parent.name
            for p in left} == {f"{5:016x}"}, left


def test_two_operators_chained_in_one_query(spark: Any, tmp_path: Path) -> None:  # noqa: F811
    from pyspark.sql import functions as F

    _write_files(tmp_path, 0, 4)
    counts = DstlStatefulOperator(name="counts", processor=Count, key_column="key",
                                  output_schema="key string, count bigint",
                                  state_uri=str(tmp_path / "state-a"), partitions=2,
                                  materialization_interval_s=None)
    totals = DstlStatefulOperator(name="totals", processor=GroupTotal, key_column="grp",
                                  output_schema="grp string, total bigint",
                                  state_uri=str(tmp_path / "state-b"), partitions=3,
                                  materialization_interval_s=None)

    plans: list[str] = []

    def query(src: Any) -> Any:
        # per batch, each key's running count, then per group (the key's last digit) the
        # number of those rows received so far
        out = (counts.transform(src)
               .select(F.substring("key", 3, 1).alias("grp"), "count")
               .transform(totals))
        plans.append(out._jdf.queryExecution().analyzed().toString())
        return out

    try:
        _run(spark, totals, tmp_path, out=query)
        assert counts.wait_for_checkpoint(3)
        # Spark's plan (SQL tab, explain) names each operator's state tasks
        assert "dstl_counts(" in plans[0] and "dstl_totals(" in plans[0], plans[0]
    finally:
        counts.close()
        totals.close()
    # the model: counts emits one row per (batch, key); totals counts them per group
    per_group: Counter[str] = Counter()
    want: Counter[tuple[str, int]] = Counter()
    for i in range(4):
        batch = Counter(k[2] for k in set(_file_keys(i)))
        for grp, n in batch.items():
            per_group[grp] += n
            want[(grp, per_group[grp])] += 1
    assert _read_rows(spark, tmp_path / "out", "grp", "total") == want


def test_transform_refuses_what_it_cannot_do(spark: Any, tmp_path: Path) -> None:  # noqa: F811
    op = DstlStatefulOperator(name="c", processor=Count, key_column="key",
                              output_schema="key string, count bigint",
                              state_uri=str(tmp_path / "s"), sink=lambda df, b: None)
    stream = spark.readStream.format("rate").load().selectExpr("cast(value as string) as key")
    with pytest.raises(UsageError, match="only foreach_batch supports"):
        op.transform(stream)
    op = DstlStatefulOperator(name="c", processor=Count, key_column="key",
                              output_schema="key string, count bigint",
                              state_uri=str(tmp_path / "s"))
    with pytest.raises(UsageError, match="takes a streaming DataFrame"):
        op.transform(spark.range(3).selectExpr("cast(id as string) as key"))
    op.close()
    late = {"event_time_column": "ts", "watermark_delay": 5, "late_rows": "side_output"}
    op = DstlStatefulOperator(name="c", processor=Count, key_column="key",
                              output_schema="key string, count bigint",
                              state_uri=str(tmp_path / "s"), late_sink=lambda df, b: None,
                              **late)
    with pytest.raises(UsageError, match="late_sink, which only foreach_batch supports; "
                                         "inside the query late rows are rows of the output"):
        op.transform(stream)
    op = DstlStatefulOperator(name="c", processor=Count, key_column="key",
                              output_schema="key string, count bigint",
                              state_uri=str(tmp_path / "s"), **late)
    with pytest.raises(UsageError, match="no late_sink: foreach_batch hands late rows"):
        op.foreach_batch(stream, 0)


@pytest.mark.timeout(900)  # two Spark drivers in turn, each in a process of its own
@pytest.mark.parametrize(("store", "table", "kill_at"), KILL_POINTS)
def test_a_driver_killed_at_each_step_loses_nothing_and_repeats_nothing(
        spark: Any, tmp_path: Path, request: pytest.FixtureRequest, store: str, table: str,  # noqa: F811
        kill_at: str) -> None:
    env = _kill_and_restart(tmp_path, request, store, table, kill_at, {})
    assert _read_rows(spark, tmp_path / "out", "key", "count") == _without_batch(
        _counts_model(5))
    # every batch has its checkpoint: the newest is the last batch's
    from dstl.checkpoint import CheckpointCoordinator
    from dstl.stores import open_store

    options = env.get("DSTL_TEST_STORAGE_OPTIONS")
    state = open_store(env.get("DSTL_TEST_STATE_URI", str(tmp_path / "state")),
                       json.loads(options) if options else None)
    try:
        coordinator = CheckpointCoordinator.recover(state, "counts")
        latest = coordinator.latest()
        coordinator.close()
    finally:
        state.close()
    assert latest is not None and latest.checkpoint_id == 4


def _kill_and_restart(tmp_path: Path, request: pytest.FixtureRequest, store: str, table: str,
                      kill_at: str, extra: dict[str, str], first: int = 3, files: int = 5
                      ) -> dict[str, str]:
    """Run in_query_driver.py over files ``0 .. first-1``, SIGKILLed at ``kill_at``, then again
    over files ``0 .. files-1`` to the end; the environment of the runs."""
    _write_files(tmp_path, 0, first)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "DSTL_TEST_TABLE": table, **extra}
    if store == "s3":
        from support.moto_server import s3_storage_options

        endpoint = request.getfixturevalue("moto_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        env["DSTL_TEST_STATE_URI"] = f"s3://{bucket}/state"
        env["DSTL_TEST_STORAGE_OPTIONS"] = json.dumps(s3_storage_options(endpoint))
    driver = [sys.executable, str(HERE / "in_query_driver.py"), str(tmp_path)]
    killed = subprocess.run([*driver, "3", kill_at], env=env, capture_output=True, text=True,
                            timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    _write_files(tmp_path, first, files)
    second = subprocess.run([*driver, "3"], env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    return env


class SeededCount(Count):
    """:class:`Count` that starts each key from its initial state rows' ``start``."""

    def handle_initial_state(self, key: Any, initial_state: dict[str, Any],
                             timer_values: Any) -> None:
        self.count.update((self.count.get() or 0) + initial_state["start"])


def _state_counts(spark: Any, state: Path) -> dict[str, int]:  # noqa: F811
    """The operator's newest checkpoint read back: key -> count."""
    rows = (spark.read.format("dstl").option("operator", "counts").option("state", "count")
            .load(str(state)).collect())
    return {r["key"]: json.loads(r["value"]) for r in rows}


def test_the_initial_state_is_applied_once_inside_the_query(
        spark: Any, tmp_path: Path) -> None:  # noqa: F811
    _write_files(tmp_path, 0, 2)
    init = spark.createDataFrame(SEEDS, "key string, start long")
    state = tmp_path / "state"

    def op_of(partitions: int, run: int) -> DstlStatefulOperator:
        return DstlStatefulOperator(name="counts", processor=SeededCount, key_column="key",
                                    output_schema="key string, count bigint",
                                    state_uri=str(state), partitions=partitions,
                                    local_dir=str(tmp_path / f"local-{run}"),
                                    materialization_interval_s=None, initial_state=init)

    src = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1)
           .json(str(tmp_path / "in")))
    # a staging that stopped before its marker left an object: the next staging deletes it
    staged = state / "query" / "initial"
    leftover = staged / "s-0-dead" / "p00000-0.arrow"
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half")
    op = op_of(4, 0)
    op.transform(src)  # stages the initial state; the query never starts (its driver stops)
    op.close()
    marker = (staged / "staged.json").read_text()
    assert not leftover.exists() and json.loads(marker), marker
    # the next driver, with 3 partitions, applies what the first one staged for 4
    op = op_of(3, 1)
    try:
        op.transform(src)
        assert (staged / "staged.json").read_text() == marker  # not staged again
        _run(spark, op, tmp_path)
    finally:
        op.close()
    want, seen = _seeded_model(2)
    assert _read_rows(spark, tmp_path / "out", "key", "count") == want
    assert not [p for p in staged.rglob("*") if p.is_file()]  # gone with the first checkpoint
    # a restart with its checkpoint: the initial state is not applied again
    _write_files(tmp_path, 2, 3)
    op = op_of(2, 2)
    try:
        _run(spark, op, tmp_path)
    finally:
        op.close()
    want, seen = _seeded_model(3)
    assert _read_rows(spark, tmp_path / "out", "key", "count") == want
    # seeded keys the input never had are in the state too
    assert _state_counts(spark, state) == dict(seen)


@pytest.mark.timeout(900)  # two Spark drivers in turn, each in a process of its own
@pytest.mark.skipif(not DEEP, reason="DSTL_DEEP=1: a driver SIGKILLed while the initial state "
                                     "is applied (two drivers per case)")
@pytest.mark.parametrize(("store", "kill_at"), INITIAL_KILL_POINTS)
def test_a_driver_killed_while_the_initial_state_is_applied_applies_it_once(
        spark: Any, tmp_path: Path, request: pytest.FixtureRequest, store: str,  # noqa: F811
        kill_at: str) -> None:
    # the first run reaches batch 0 only: it is killed there (or in the staging before it)
    _kill_and_restart(tmp_path, request, store, "lmdb", kill_at,
                      {"DSTL_TEST_INITIAL": "1", "DSTL_TEST_KILL_BATCH": "0"}, first=1, files=2)
    want, seen = _seeded_model(2)
    assert _read_rows(spark, tmp_path / "out", "key", "count") == want
    if store == "local":
        assert _state_counts(spark, tmp_path / "state") == dict(seen)


DELAY_MS = 1_500


def _event_rows(i: int) -> list[tuple[str, int]]:
    """File ``i`` of the late-rows test: 30 rows (key, event time ms), some far behind."""
    rng = random.Random(i)
    return [(f"u{rng.randrange(6)}", rng.randrange(max(0, i - 2) * 1_000, (i + 1) * 1_000))
            for _ in range(30)]


def _write_event_files(work: Path, lo: int, hi: int) -> None:
    (work / "in").mkdir(parents=True, exist_ok=True)
    for i in range(lo, hi):
        tmp = work / f"f{i:03d}.tmp"
        tmp.write_text("".join(json.dumps({"key": k, "et": et}) + "\n"
                               for k, et in _event_rows(i)))
        os.utime(tmp, (1_700_000_000 + i, 1_700_000_000 + i))
        tmp.rename(work / "in" / f"f{i:03d}.json")


def _late_model(files: int) -> tuple[Counter[tuple[str, int]], Counter[tuple[str, int]],
                                     list[int]]:
    """Spark's watermark rule, written out: a batch's watermark is the largest on-time event
    time of the batches before it minus the delay (0 at first, never decreasing); a row at or
    below it is late. The count rows of the on-time rows, the late rows, late rows per batch."""
    wm, counts = 0, Counter[str]()
    out: Counter[tuple[str, int]] = Counter()
    late: Counter[tuple[str, int]] = Counter()
    per_batch = []
    for i in range(files):
        rows = _event_rows(i)
        on_time = [r for r in rows if r[1] > wm]
        late.update(r for r in rows if r[1] <= wm)
        per_batch.append(len(rows) - len(on_time))
        for k, n in Counter(k for k, _ in on_time).items():
            counts[k] += n
            out[(k, counts[k])] += 1
        if on_time:
            wm = max(wm, max(et for _, et in on_time) - DELAY_MS)
    return out, late, per_batch


def test_late_rows_reach_the_sink_in_the_late_column(spark: Any, tmp_path: Path  # noqa: F811
                                                     ) -> None:
    _write_event_files(tmp_path, 0, 4)

    def op_of(partitions: int, run: int) -> DstlStatefulOperator:
        return DstlStatefulOperator(name="counts", processor=Count, key_column="key",
                                    output_schema="key string, count bigint",
                                    state_uri=str(tmp_path / "state"), partitions=partitions,
                                    local_dir=str(tmp_path / f"local-{run}"),
                                    materialization_interval_s=None, event_time_column="et",
                                    watermark_delay=f"{DELAY_MS} ms", late_rows="side_output")

    def run(op: DstlStatefulOperator) -> Any:
        src = (spark.readStream.schema("key string, et long").option("maxFilesPerTrigger", 1)
               .json(str(tmp_path / "in")))
        return _run_df(spark, op, op.transform(src), tmp_path)

    op = op_of(3, 0)
    try:
        q = run(op)
        # late rows are counted where Spark users look
        assert [m["numLateRows"] for m in _observed(q, "counts")] == _late_model(4)[2]
    finally:
        op.close()
    _write_event_files(tmp_path, 4, 7)
    op = op_of(2, 1)  # a restart with another partition count: the watermark continues
    try:
        q = run(op)
        assert [m["numLateRows"] for m in _observed(q, "counts")] == _late_model(7)[2][4:]
    finally:
        op.close()
    want, late, per_batch = _late_model(7)
    assert sum(per_batch) > 10 and len(late) < sum(len(_event_rows(i)) for i in range(7))
    rows = spark.read.parquet(str(tmp_path / "out")).collect()
    assert Counter((r["key"], r["count"]) for r in rows if r["late_row"] is None) == want
    assert Counter((r["late_row"]["key"], r["late_row"]["et"]) for r in rows
                   if r["late_row"] is not None) == late
    assert all(r["key"] is None and r["count"] is None for r in rows if r["late_row"] is not None)
