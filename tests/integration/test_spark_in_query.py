"""The operator inside the user's query (``op.transform(df)``): a streaming DataFrame out, written
by Spark's Parquet file sink, exactly-once against a model computed here from the input files —
with a task whose worker is killed (Spark retries it), across a query restart with a changed
partition count, with two DSTL operators chained in one query, and with the driver SIGKILLed
after Spark's commit and before DSTL's manifest; ``DSTL_DEEP=1`` adds the heap table and
SIGKILLs while the state tasks run, once they are done (before Spark's commit) and after DSTL's
manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
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


def _without_batch(model: Counter[tuple[int, str, int]]) -> Counter[tuple[str, int]]:
    return Counter({(k, c): n for (_, k, c), n in model.items()})


def _read_rows(spark: Any, path: Path, *cols: str) -> Counter[tuple[Any, ...]]:  # noqa: F811
    """The committed rows of a Parquet file sink (read through its ``_spark_metadata``)."""
    return Counter(tuple(r) for r in spark.read.parquet(str(path)).select(*cols).collect())


def _run(spark: Any, op: Any, work: Path, out: Any = None) -> Any:  # noqa: F811
    src = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1)
           .json(str(work / "in")))
    df = (out or (lambda d: d.transform(op)))(src)
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


@pytest.mark.timeout(900)  # two Spark drivers in turn, each in a process of its own
@pytest.mark.parametrize(("store", "table", "kill_at"), KILL_POINTS)
def test_a_driver_killed_at_each_step_loses_nothing_and_repeats_nothing(
        spark: Any, tmp_path: Path, request: pytest.FixtureRequest, store: str, table: str,  # noqa: F811
        kill_at: str) -> None:
    _write_files(tmp_path, 0, 3)
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "DSTL_TEST_TABLE": table}
    if store == "s3":
        from support.moto_server import s3_storage_options

        endpoint = request.getfixturevalue("moto_endpoint")
        bucket = request.getfixturevalue("s3_bucket")
        env["DSTL_TEST_STATE_URI"] = f"s3://{bucket}/state"
        env["DSTL_TEST_STORAGE_OPTIONS"] = json.dumps(s3_storage_options(endpoint))
    driver = [sys.executable, str(HERE / "in_query_driver.py"), str(tmp_path)]
    first = subprocess.run([*driver, "3", kill_at], env=env, capture_output=True, text=True,
                           timeout=600)
    assert first.returncode == -9, first.stderr[-3000:]
    _write_files(tmp_path, 3, 5)
    second = subprocess.run([*driver, "3"], env=env, capture_output=True, text=True,
                            timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
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
