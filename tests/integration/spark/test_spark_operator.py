"""The PySpark operator end to end on local[2,2] with S3 on a moto server: exact counts across
batches, a task killed on its first attempt, a batch re-run, a failing processor, bad input."""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spark_support import spark  # noqa: F401
from support import moto_server
from support.moto_server import s3_storage_options
from support.processors import Count, Poison

from dstl import key_group_for
from dstl.errors import AccessDeniedError, ConfigError
from dstl.spark import DstlStatefulOperator, StatefulProcessor

pytestmark = [pytest.mark.spark, pytest.mark.s3, pytest.mark.xdist_group("spark")]
moto_endpoint = moto_server.moto_endpoint
s3_bucket = moto_server.s3_bucket


class CrashOnce(Count):
    """Kills its Python worker on the first attempt of partition 1 (Spark retries the task);
    ``flag`` (set on a subclass made per test) records that it happened."""

    flag = ""

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        flag = self.flag
        if ctx is not None and ctx.partitionId() == 1 and ctx.attemptNumber() == 0 \
                and flag and not os.path.exists(flag):
            Path(flag).write_text("crashed")
            os._exit(137)
        yield from super().handle_input_rows(key, rows)


class FailOnceOnKey(Count):
    """Raises (the Python worker lives on) on the first attempt that sees ``key``, or with
    ``kill`` kills its Python worker (the task's work so far dies with it, uncommitted);
    ``flag`` (set on a subclass made per test) records that it happened."""

    flag = ""
    key = ""
    kill = False

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        if key == self.key and self.flag and not os.path.exists(self.flag):
            Path(self.flag).write_text("failed")
            if self.kill:
                os._exit(137)
            raise RuntimeError("fails once")
        yield from super().handle_input_rows(key, rows)


def _op(processor: type, uri: str, opts: dict[str, Any], sink: Any, tmp: Path,
        **kw: Any) -> DstlStatefulOperator:
    return DstlStatefulOperator(name="count", processor=processor, key_column="key",
                                output_schema="key string, count long", state_uri=uri,
                                storage_options=opts, partitions=3,
                                max_parallelism=kw.pop("max_parallelism", 32),
                                sink=sink, local_dir=str(tmp / "local"),
                                materialization_interval_s=kw.pop("mat_s", 0.0), **kw)


def _batch(spark: Any, keys: list[str]) -> Any:  # noqa: F811
    return spark.createDataFrame([(k,) for k in keys], "key string")


@pytest.mark.parametrize("table", ["lmdb", "heap"])
def test_counts_exact_across_batches_retry_and_rerun(spark: Any, moto_endpoint: str,  # noqa: F811
                                                     s3_bucket: str, tmp_path: Path,
                                                     table: str) -> None:
    # made here, so cloudpickle ships it by value with the flag path in it
    crash_once = type("CrashOnceHere", (CrashOnce,), {"flag": str(tmp_path / "crashed")})
    latest: dict[str, int] = {}

    def sink(out_df: Any, batch_id: int) -> None:
        for r in out_df.collect():
            latest[r["key"]] = r["count"]

    op = _op(crash_once, f"s3://{s3_bucket}/app-{table}", s3_storage_options(moto_endpoint),
             sink, tmp_path, table=table)
    batches = [[f"u{i % 7}" for i in range(b, b + 40)] for b in range(5)]
    expected: Counter[str] = Counter()
    for batch_id, keys in enumerate(batches):
        op.foreach_batch(_batch(spark, keys), batch_id)
        expected.update(keys)
        assert latest == dict(expected), f"after batch {batch_id}"
    assert (tmp_path / "crashed").exists()  # the first attempt of a task really died
    # a re-run of the last batch (Spark does it after a failure) gives the same state
    op.foreach_batch(_batch(spark, batches[-1]), len(batches) - 1)
    assert latest == dict(expected)
    op.foreach_batch(_batch(spark, ["u0", "u0"]), len(batches))
    expected.update(["u0", "u0"])
    assert latest == dict(expected)
    stats = op.batch_stats
    assert sum(s["materializations"] for s in stats) > 0
    assert any(s["restores"] for s in stats)  # re-run and retry restored from the store
    op.close()


@pytest.mark.parametrize("table", ["lmdb", "heap"])
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_task_of_two_partitions_failing_in_its_second_is_retried_whole(
        spark: Any, moto_endpoint: str, s3_bucket: str, tmp_path: Path,  # noqa: F811
        table: str, how: str) -> None:
    """3 partitions on 2 task slots: Spark task 0 runs partitions 0 then 2. In batch 1 the
    processor fails once in partition 2 (raises, or SIGKILLs its Python worker), after
    partition 0 was processed in the same task (its checkpoint not yet requested: a task
    checkpoints once all its partitions are processed). Spark retries the task whole and every
    count stays exact. Partition 0 runs again from the base, never from a table past it: after
    a raise it was rolled back and dropped (restored); after a kill its open write transaction
    died with the worker, so with LMDB the retry finds its table still at the base and adopts
    it. Which worker runs the retry is Spark's choice: when it is the other one, which ran
    partition 0 in batch 0 and still holds it at the base, the retry finds it there (a hit)."""
    mp = 32

    def partition_of(key: str) -> int:
        return key_group_for(key.encode(), mp) * 3 // mp

    keys = [f"u{i}" for i in range(60)]
    by_partition = {p: [k for k in keys if partition_of(k) == p] for p in range(3)}
    assert all(len(v) >= 3 for v in by_partition.values())
    victim = by_partition[2][0]
    failing = type("FailOnceHere", (FailOnceOnKey,),
                   {"flag": str(tmp_path / "failed"), "key": victim, "kill": how == "kill"})
    latest: dict[str, int] = {}

    def sink(out_df: Any, batch_id: int) -> None:
        for r in out_df.collect():
            latest[r["key"]] = r["count"]

    op = _op(failing, f"s3://{s3_bucket}/grouped-{how}-{table}",
             s3_storage_options(moto_endpoint), sink, tmp_path, table=table, max_parallelism=mp,
             mat_s=None)
    assert op._task_count(spark) == 2
    batches = [[k for k in keys if k != victim], keys, keys[::3]]
    expected: Counter[str] = Counter()
    for batch_id, batch in enumerate(batches):
        op.foreach_batch(_batch(spark, batch), batch_id)
        expected.update(batch)
        assert latest == dict(expected), f"after batch {batch_id}"
    assert (tmp_path / "failed").exists()
    retried = {t["partition"]: t for t in op.batch_stats[1]["tasks"]}
    assert retried[0]["attempt"] == retried[2]["attempt"] == 1, retried
    assert retried[1]["attempt"] == 0, retried
    assert retried[0]["pid"] == retried[2]["pid"], retried  # both in one task (one worker)
    first = {t["partition"]: t for t in op.batch_stats[0]["tasks"]}
    if retried[0]["access"] == "hit":  # the worker that kept partition 0 since batch 0
        assert retried[0]["pid"] == first[0]["pid"], (first, retried)
    elif table == "lmdb":
        assert retried[0]["access"] == ("restore" if how == "raise" else "adopt"), retried
    op.close()


def test_failing_processor_fails_the_batch_and_leaves_state_unchanged(
        spark: Any, moto_endpoint: str, s3_bucket: str, tmp_path: Path) -> None:  # noqa: F811
    latest: dict[str, int] = {}

    def sink(out_df: Any, batch_id: int) -> None:
        for r in out_df.collect():
            latest[r["key"]] = r["count"]

    op = _op(Poison, f"s3://{s3_bucket}/poison", s3_storage_options(moto_endpoint), sink,
             tmp_path)
    op.foreach_batch(_batch(spark, ["a", "b", "a"]), 0)
    with pytest.raises(Exception) as info:
        op.foreach_batch(_batch(spark, ["a", "poison", "b"]), 1)
    # Spark's summary line is DSTL's error naming where it happened, with the original's type
    assert re.search(r"ProcessorError: processor Poison of operator 'count' raised ValueError "
                     r"in handle_input_rows for key 'poison' \(partition \d, batch 1\): "
                     r"processor refused the poison key", str(info.value)), str(info.value)
    op.foreach_batch(_batch(spark, ["a", "b"]), 1)  # Spark re-runs the batch (fixed input here)
    assert latest == {"a": 3, "b": 2}
    op.close()


def test_bad_state_uri_fails_before_any_batch(spark: Any, moto_endpoint: str,  # noqa: F811
                                              tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="scheme"):
        _op(Count, "ftpx://nowhere/app", None, None, tmp_path).validate(spark)
    with pytest.raises(AccessDeniedError, match="no-such-bucket"):
        _op(Count, "s3://no-such-bucket/app", s3_storage_options(moto_endpoint), None,
            tmp_path).validate(spark)


def test_agent_materializes_partitions_and_restores_through_its_cache(
        spark: Any, moto_endpoint: str, s3_bucket: str, tmp_path: Path) -> None:  # noqa: F811
    """The executor agent snapshots the LMDB partitions (tasks install
    the snapshots into their checkpoints, so the log to replay stays short), and a partition
    that lost its local table restores through the agent's cache."""
    latest: dict[str, int] = {}

    def sink(out_df: Any, batch_id: int) -> None:
        for r in out_df.collect():
            latest[r["key"]] = r["count"]

    op = _op(Count, f"s3://{s3_bucket}/agent-mat", s3_storage_options(moto_endpoint), sink,
             tmp_path, table="lmdb")
    expected: Counter[str] = Counter()
    batch_id = 0
    for _ in range(6):
        keys = [f"m{i % 11}" for i in range(batch_id, batch_id + 50)]
        op.foreach_batch(_batch(spark, keys), batch_id)
        expected.update(keys)
        batch_id += 1
    assert latest == dict(expected)
    stats = op.batch_stats
    assert sum(s["materializations"] for s in stats) > 0  # agent snapshots were installed
    agent = next(a for s in reversed(stats) for a in s["agents"].values())
    assert agent["agent.materializer.completed"] > 0
    assert agent["agent.materializer.failed"] == 0
    # the newest checkpoint stands on an agent snapshot: only the log after it is referenced
    last = op.coordinator.latest()
    assert any(t.state["materialized"] for t in last.tasks)
    # every partition loses its local table: the next batch restores, through the agent cache
    local = tmp_path / "local" / "dstl" / "count"
    for batch_id_file in local.glob("p*.batch-id"):
        batch_id_file.unlink()
    keys = [f"m{i % 11}" for i in range(30)]
    op.foreach_batch(_batch(spark, keys), batch_id)
    expected.update(keys)
    assert latest == dict(expected)
    restore_stats = op.batch_stats[-1]
    assert restore_stats["restores"] == 3, restore_stats["accesses"]
    agent = next(iter(restore_stats["agents"].values()))
    assert agent["agent.cache.downloads"] > 0
    assert agent["agent.cache.leases_open"] == 0
    op.close()


@pytest.mark.parametrize("table,mat_s", [
    ("lmdb", 0.0),
    pytest.param("heap", None, marks=pytest.mark.skipif(
        not os.environ.get("DSTL_DEEP"), reason="DSTL_DEEP=1: the heap table (rescaling the "
                                                "heap is in CI in test_restore_roundtrip)")),
])
def test_changing_partitions_twice_keeps_counts_exact(spark: Any, moto_endpoint: str,  # noqa: F811
                                                      s3_bucket: str, tmp_path: Path,
                                                      table: str, mat_s: float | None) -> None:
    """The query restarts with `partitions` 1 -> 2 -> 1 -> 3 -> 2 (the same Python
    workers serve every layout), two batches per layout. Each restart restores every partition
    from the handles of the previous layout; counts stay exact. Heap without materializations
    (every restore replays the whole log, through every earlier layout's handles) and LMDB with
    a materialization after every batch. A restore that kept the whole restored log in both halves
    would count the rows of the first layout twice after 1 -> 2 -> 1."""
    latest: dict[str, int] = {}

    def sink(out_df: Any, batch_id: int) -> None:
        for r in out_df.collect():
            latest[r["key"]] = r["count"]

    uri, opts = f"s3://{s3_bucket}/rescale-{table}", s3_storage_options(moto_endpoint)
    expected: Counter[str] = Counter()
    batch_id = 0
    layouts = (1, 2, 1, 3, 2)
    for n, partitions in enumerate(layouts):
        op = DstlStatefulOperator(name="count", processor=Count, key_column="key",
                                  output_schema="key string, count long", state_uri=uri,
                                  storage_options=opts, partitions=partitions,
                                  max_parallelism=32, sink=sink, table=table,
                                  local_dir=str(tmp_path / "local"),
                                  materialization_interval_s=mat_s)
        try:
            for _ in range(2):
                keys = [f"r{(batch_id * 5 + i) % 13}" for i in range(30)]
                op.foreach_batch(_batch(spark, keys), batch_id)
                expected.update(keys)
                batch_id += 1
                assert latest == dict(expected), f"layouts {layouts[:n + 1]}, batch {batch_id - 1}"
            first = op.batch_stats[0]
            if n > 0:
                assert first["accesses"] == ["rescale"] * partitions, first["accesses"]
        finally:
            op.close()


def _keys_in_partitions(wanted: set[int], partitions: int, max_parallelism: int, per: int
                        ) -> list[str]:
    """``per`` keys routed to each partition in ``wanted`` (the operator's routing:
    ``key_group * P div max_parallelism``), none to any other partition."""
    from dstl.keygroups import key_group_for

    out: dict[int, list[str]] = {p: [] for p in wanted}
    i = 0
    while any(len(v) < per for v in out.values()):
        k = f"k{i}"
        p = key_group_for(k.encode(), max_parallelism) * partitions // max_parallelism
        if p in out and len(out[p]) < per:
            out[p].append(k)
        i += 1
    return [k for v in out.values() for k in v]


def test_sink_gets_every_row_when_partitions_before_the_last_emit_nothing(
        spark: Any, tmp_path: Path) -> None:  # noqa: F811
    """Partitions without output rows (they still report) come before and between the ones
    with rows: pyspark's createDataFrame from an Arrow table stops at an empty record batch
    followed by more (it read 0 of [0, 0, n] rows, 130 of [130, 0, 135]), so the sink must
    not get the tasks' chunks as they are."""
    got: list[tuple[str, int]] = []

    def sink(out_df: Any, batch_id: int) -> None:
        got.extend((r["key"], r["count"]) for r in out_df.collect())

    op = DstlStatefulOperator(name="count", processor=Count, key_column="key",
                              output_schema="key string, count long",
                              state_uri=str(tmp_path / "state"), partitions=4,
                              max_parallelism=32, sink=sink, local_dir=str(tmp_path / "local"))
    seen: Counter[str] = Counter()
    try:
        for batch_id, wanted in enumerate(({1, 3}, {2}, set())):
            keys = _keys_in_partitions(wanted, 4, 32, per=3)
            seen.update(keys)
            got.clear()
            op.foreach_batch(_batch(spark, keys) if keys else
                             spark.createDataFrame([], "key string"), batch_id)
            assert sorted(got) == sorted((k, seen[k]) for k in keys), f"batch {batch_id}"
            assert op.batch_stats[-1]["rows_out"] == len(keys)
    finally:
        op.close()


class FreezeCount(StatefulProcessor):
    """Outputs, per key, how many objects the worker's collector has frozen."""

    def init(self, handle: Any) -> None:
        pass

    def handle_input_rows(self, key: Any, rows: Iterator[dict[str, Any]]
                          ) -> Iterator[dict[str, Any]]:
        import gc

        yield {"key": key, "count": gc.get_freeze_count()}


def test_a_worker_freezes_its_imports_for_the_collector_before_its_first_task(
        spark: Any, tmp_path: Path) -> None:  # noqa: F811
    """pyspark's daemon runs gc.collect() after every task of a reused worker: DSTL freezes what
    the worker imported (dstl.spark.worker_gc), so those collections skip it."""
    out: dict[str, int] = {}
    op = _op(FreezeCount, str(tmp_path / "store"), {}, lambda df, b: out.update(
        {r["key"]: r["count"] for r in df.collect()}), tmp_path)
    try:
        op.foreach_batch(_batch(spark, [f"k{i}" for i in range(12)]), 0)
    finally:
        op.close()
    assert len(out) == 12
    assert min(out.values()) > 10_000, out  # pyarrow, pyspark and DSTL at least
