"""spark.read.format("dstl"): a checkpoint's state and the batch change feed as DataFrames,
equal to the job's dict model; pushed-down key and key-group filters plan only the key groups
that can match; a typed value column; a missing checkpoint and a misspelt, ignored or
out-of-range option are typed errors in Spark's message; a stream whose start fell out of the job's
retention fails naming the lost checkpoints, or resumes after the oldest retained one.
The job is tests/support/state_job.py's MiniJob (Spark reads what it wrote)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spark_support import spark  # noqa: F401 - the shared session fixture
from support.state_job import MiniJob, replay, state_of

from dstl.keygroups import key_group_for
from dstl.reader import from_json
from dstl.spark import register
from dstl.stores import open_store

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


class _Row:
    def __init__(self, r: Any) -> None:
        d = r.asDict()
        for f in ("namespace", "user_key", "value"):
            d[f] = from_json(d[f])
        if d["key"] is None:
            d["key"] = bytes(d["key_bytes"])
        self.__dict__.update(d)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, MiniJob]]:
    root = str(tmp_path_factory.mktemp("reader") / "state")
    store = open_store(root)
    job = MiniJob(store, partitions=2, max_parallelism=16, table="lmdb", seed=41, retained=5)
    job.run(150)
    job.checkpoint()
    job.run(50)
    job.materialize()
    job.run(80)
    job.checkpoint()
    job.rescale(3)
    job.run(80)
    job.checkpoint()
    job.close()
    store.close()
    yield root, job


def _load(session: Any, root: str, **options: Any) -> Any:
    reader = session.read.format("dstl").option("operator", "job")
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load(root)


def test_state_of_every_checkpoint_equals_the_model(spark: Any,  # noqa: F811
                                                    job: tuple[str, MiniJob]) -> None:
    root, model = job
    register(spark)
    for cid in (0, 1):
        rows = [_Row(r) for r in _load(spark, root, checkpoint=cid).collect()]
        assert state_of(rows) == model.checkpoint_models[cid], cid
        assert {r.checkpoint for r in rows} == {cid}
    assert _load(spark, root).rdd.getNumPartitions() == 3  # one per backend handle
    newest = _load(spark, root, keyGroupsPerSplit=4)
    assert newest.rdd.getNumPartitions() == 6  # 16 key groups in 3 handles: 6, 5, 5
    assert state_of(_Row(r) for r in newest.collect()) == model.checkpoint_models[2]


def test_filters_on_key_and_key_group_are_pushed_down(spark: Any,  # noqa: F811
                                                      job: tuple[str, MiniJob]) -> None:
    root, model = job
    register(spark)
    df = _load(spark, root).filter("key = 'k7'")
    assert df.rdd.getNumPartitions() == 1
    rows = [_Row(r) for r in df.collect()]
    assert rows and state_of(rows) == {i: v for i, v in model.model.items() if i[1] == "k7"}
    kg = key_group_for(b"k7", 16)
    by_kg = _load(spark, root).filter(f"key_group >= {kg} and key_group <= {kg}")
    assert by_kg.rdd.getNumPartitions() == 1
    assert {r.key_group for r in by_kg.collect()} == {kg}
    counts = _load(spark, root, state="count", valueType="bigint").filter(
        "key in ('k1', 'k2', 'k3')")
    got = {r.key: r.typed_value for r in counts.collect()}
    assert got == {i[1]: v for i, v in model.model.items()
                   if i[0] == "count" and i[1] in ("k1", "k2", "k3")}


def test_batch_change_feed_replays_to_the_model(spark: Any,  # noqa: F811
                                                job: tuple[str, MiniJob]) -> None:
    root, model = job
    register(spark)
    for start, end in ((0, 2), (1, 2), (None, 1)):
        opts: dict[str, Any] = {"readChangeFeed": "true", "endCheckpoint": end}
        if start is not None:
            opts["startCheckpoint"] = start
        rows = [_Row(r) for r in _load(spark, root, **opts).collect()]
        rows.sort(key=lambda r: (r.checkpoint, r.partition, r.seq))
        base = model.checkpoint_models[start] if start is not None else None
        assert replay(rows, base) == model.checkpoint_models[end], (start, end)
    streamed = spark.read.format("dstl_changes").option("startCheckpoint", 1).load(root)
    assert streamed.count() == _load(spark, root, readChangeFeed="true",
                                     startCheckpoint=1).count()


def test_a_read_that_plans_no_split_has_no_rows(spark: Any,  # noqa: F811
                                                job: tuple[str, MiniJob]) -> None:
    # Spark reads a source with no splits through one InputPartition(None) of its own
    root, _ = job
    register(spark)
    for heap in (True, False):  # the column-wise path and the row path (the lmdb table)
        none = _load(spark, root, **({} if heap else {"table": "lmdb"})).filter(
            "partition = 'no-such-partition'")
        assert none.rdd.getNumPartitions() == 1
        assert none.collect() == []
        assert none.count() == 0
    newest = max(model_id for model_id in job[1].checkpoint_models)
    empty_feed = _load(spark, root, readChangeFeed="true", startCheckpoint=newest)
    assert empty_feed.collect() == []
    assert _load(spark, root, readChangeFeed="true", startCheckpoint=newest - 1).count() > 0
    assert len(_load(spark, root).filter("key = 'k7'").collect()) > 0


def test_a_missing_checkpoint_is_a_typed_error(spark: Any,  # noqa: F811
                                               job: tuple[str, MiniJob]) -> None:
    root, _ = job
    register(spark)
    with pytest.raises(Exception, match="CheckpointNotFoundError") as err:
        _load(spark, root, checkpoint=42).collect()
    assert "checkpoints there: 0, 1, 2" in str(err.value)
    # every option is named and range-checked (dstl/reader/checks.py; each option's refusal
    # is a unit test in tests/unit/dstl/reader/test_state_reader_edges.py): a misspelt one would otherwise
    # read the newest checkpoint instead of the one asked for
    with pytest.raises(Exception, match=r"ConfigError.*checkpiont"):
        _load(spark, root, checkpiont=0).collect()
    # a typed value the state's values do not convert to names the state, a key and the value
    # (through a user schema; valueType's path: tests/unit/dstl/reader/test_state_reader_columns.py)
    reader = (spark.read.format("dstl").schema("key string, typed_value array<int>")
              .option("operator", "job").option("state", "count").load(root))
    with pytest.raises(Exception, match=r"ValueTypeError: state 'count', key 'k\d+': "
                                        r"value \d+ \(int\) does not convert"):
        reader.collect()
    query = None
    with pytest.raises(Exception, match=r"ConfigError.*dstl_changes") as refused:
        query = (spark.readStream.format("dstl").load(root)  # the stream is dstl_changes
                 .writeStream.format("noop").start())
        query.awaitTermination(120)
    # DSTL's error is the one Spark reports, not the context of an error of PySpark's runner
    assert "UnboundLocalError" not in str(refused.value), str(refused.value)
    if query is not None:
        query.stop()


def _stream_rows(session: Any, root: str, where: Path, **options: Any) -> list[Any]:
    """One availableNow run of a dstl_changes stream; its rows (re-raises the query's error).
    Spark gives a streaming source's Python process a fixed 10 s to connect back, too short on
    a loaded host: that failure (only that one) is retried from the query's checkpoint."""
    got: list[Any] = []  # across attempts: a retry resumes after the batches Spark committed
    for attempt in range(4):
        reader = session.readStream.format("dstl_changes").option("operator", "job")
        for k, v in options.items():
            reader = reader.option(k, v)
        query = (reader.load(root).writeStream
                 .foreachBatch(lambda df, _: got.extend(df.collect()))
                 .option("checkpointLocation", str(where)).trigger(availableNow=True).start())
        error: Any = None
        try:
            query.awaitTermination(300)
            error = query.exception()
        except Exception as exc:  # awaitTermination raises the query's error itself
            error = exc
        finally:
            query.stop()
        if error is None:
            return got
        if "failed to connect back" not in str(error) or attempt == 3:
            raise RuntimeError(str(error))
    raise AssertionError("unreachable")


def test_a_stream_behind_retention_names_what_was_lost(spark: Any,  # noqa: F811
                                                       tmp_path: Path) -> None:
    root = str(tmp_path / "state")
    store = open_store(root)
    job = MiniJob(store, partitions=2, max_parallelism=16, seed=43, retained=2)
    for _ in range(4):
        job.run(40)
        job.checkpoint()  # 0..3; retained: 2, 3
    job.close()
    store.close()
    register(spark)
    with pytest.raises(Exception, match=r"ChangesLostError.*checkpoints 1\.\.2"):
        _stream_rows(spark, root, tmp_path / "lost", startingCheckpoint=0)
    rows = [_Row(r) for r in _stream_rows(spark, root, tmp_path / "resumed",
                                          startingCheckpoint=0,
                                          onLostChanges="resumeFromOldest")]
    rows.sort(key=lambda r: (r.checkpoint, r.partition, r.seq))
    assert {r.checkpoint for r in rows} == {3}  # the changes after the oldest retained (2)
    assert replay(rows, job.checkpoint_models[2]) == job.checkpoint_models[3]


def _rows(df: Any) -> list[tuple[Any, ...]]:
    return sorted((tuple(r) for r in df.collect()), key=repr)


def _ddl_names(ddl: str) -> list[str]:
    return [pair.strip().split(" ")[0] for pair in ddl.split(",")]


@pytest.mark.parametrize("table", ["heap", "lmdb"])  # the column-wise path and the row path
def test_a_user_schema_reads_only_its_columns_in_its_order(spark: Any,  # noqa: F811
                                                           job: tuple[str, MiniJob],
                                                           table: str) -> None:
    root, _ = job
    register(spark)
    full = _load(spark, root, table=table)
    for ddl, cols in (("value string, key string, partition string",
                       ["value", "key", "partition"]),
                      ("key_bytes binary", ["key_bytes"]),
                      ("KEY string, Kind string, user_key string, namespace string, "
                       "key_group int, checkpoint bigint, state string",
                       ["key", "kind", "user_key", "namespace", "key_group", "checkpoint",
                        "state"])):
        reader = spark.read.format("dstl").schema(ddl).option("operator", "job")
        got = reader.option("table", table).load(root)
        assert got.columns == _ddl_names(ddl)
        assert _rows(got) == _rows(full.select(*cols)), ddl
    # filters still push down to the key groups that can match
    one = (spark.read.format("dstl").schema("key string, value string")
           .option("operator", "job").option("table", table).load(root).filter("key = 'k7'"))
    assert one.rdd.getNumPartitions() == 1
    assert _rows(one) == _rows(full.filter("key = 'k7'").select("key", "value"))
    # a typed value column by the schema alone (no valueType), or with it
    typed = (spark.read.format("dstl").schema("typed_value bigint, key string")
             .option("operator", "job").option("state", "count").option("table", table)
             .load(root))
    with_option = _load(spark, root, state="count", valueType="bigint", table=table)
    assert _rows(typed) == _rows(with_option.select("typed_value", "key"))


def test_a_user_schema_projects_the_change_feed_batch_and_stream(
        spark: Any, job: tuple[str, MiniJob], tmp_path: Path) -> None:  # noqa: F811
    root, _ = job
    register(spark)
    ddl = "op string, seq bigint, key string, value string, checkpoint bigint"
    full = _load(spark, root, readChangeFeed="true", startCheckpoint=0)
    batch = (spark.read.format("dstl").schema(ddl).option("operator", "job")
             .option("readChangeFeed", "true").option("startCheckpoint", 0).load(root))
    expected = _rows(full.select("op", "seq", "key", "value", "checkpoint"))
    assert _rows(batch) == expected and expected
    got: list[Any] = []
    query = (spark.readStream.format("dstl_changes").schema(ddl).option("operator", "job")
             .option("startingCheckpoint", 0).load(root).writeStream
             .foreachBatch(lambda df, _: got.extend(df.collect()))
             .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True)
             .start())
    try:
        query.awaitTermination(300)
        assert query.exception() is None
    finally:
        query.stop()
    assert sorted((tuple(r) for r in got), key=repr) == expected


def test_a_user_schema_the_source_cannot_give_is_a_typed_error(
        spark: Any, job: tuple[str, MiniJob]) -> None:  # noqa: F811
    root, _ = job
    register(spark)
    for ddl, says in (("key string, owner string", "the source has no column 'owner'"),
                      ("key int", "column 'key' is string in the source, not int"),
                      ("key string, KEY string", "column 'KEY' is named twice"),
                      ("key string not null", "column 'key' can be null"),
                      ("seq bigint", "the source has no column 'seq'")):  # a change column
        with pytest.raises(Exception, match="ConfigError") as err:
            (spark.read.format("dstl").schema(ddl).option("operator", "job").load(root)
             .collect())
        assert says in str(err.value), (ddl, str(err.value)[:2000])
        assert "dstl source.schema" in str(err.value)
