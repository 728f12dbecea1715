"""From a Spark Connect client (a server started by the test, no SparkContext in this process):
``op.transform`` runs the operator inside the query, the Parquet sink's output equals a model,
the client-side listener writes the checkpoints, the figures are in the query's progress, and
``spark.read.format("dstl")`` reads the state without registration; ``foreach_batch`` is refused
with a UsageError that names what to use."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.connect_server import connect_server
from support.processors import Count

from dstl.errors import UsageError
from dstl.spark import DstlStatefulOperator

pytestmark = [pytest.mark.spark, pytest.mark.xdist_group("spark")]


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from pyspark.sql import SparkSession

    # pyspark marks the process as a Connect client in os.environ (SPARK_CONNECT_MODE_ENABLED,
    # SPARK_REMOTE): every later SparkSession.builder would then ask for a Connect URL, so the
    # marks go when the client does (the next test module in this process starts a local one)
    marks = ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE", "SPARK_LOCAL_REMOTE")
    saved = {k: os.environ.get(k) for k in marks}
    with connect_server(tmp_path_factory.mktemp("connect")) as url:
        spark = SparkSession.builder.remote(url).getOrCreate()
        try:
            yield spark
        finally:
            spark.stop()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _named(row: Any) -> dict[str, Any]:
    """An observed-metrics row as a dict (a Connect client's progress holds it as its values
    and its schema)."""
    d = row.asDict() if hasattr(row, "asDict") else dict(row)
    if set(d) == {"values", "schema"}:
        schema = d["schema"] if isinstance(d["schema"], dict) else json.loads(d["schema"])
        return dict(zip([f["name"] for f in schema["fields"]], d["values"], strict=True))
    return d


def _keys(i: int) -> list[str]:
    return [f"k{(5 * i + j * j) % 13:02d}" for j in range(30)]


def test_transform_from_a_connect_client(remote: Any, tmp_path: Path) -> None:
    spark = remote
    assert type(spark).__module__.startswith("pyspark.sql.connect")
    (tmp_path / "in").mkdir()
    for i in range(3):
        f = tmp_path / "in" / f"f{i}.json"
        f.write_text("".join(json.dumps({"key": k}) + "\n" for k in _keys(i)))
        os.utime(f, (1_700_000_000 + i, 1_700_000_000 + i))  # oldest first: file i = batch i
    op = DstlStatefulOperator(name="counts", processor=Count, key_column="key",
                              output_schema="key string, count bigint",
                              state_uri=str(tmp_path / "state"), partitions=3,
                              materialization_interval_s=None)
    try:
        src = (spark.readStream.schema("key string").option("maxFilesPerTrigger", 1)
               .json(str(tmp_path / "in")))
        q = (op.transform(src).writeStream.format("parquet")
             .option("path", str(tmp_path / "out"))
             .option("checkpointLocation", str(tmp_path / "cp"))
             .trigger(availableNow=True).start())
        q.awaitTermination()
        assert op.wait_for_checkpoint(2)
        observed = [_named(p["observedMetrics"]["dstl.counts"]) for p in q.recentProgress]
        assert [m["numInputRows"] for m in observed] == [30, 30, 30]
        with pytest.raises(UsageError, match=r"use out = op\.transform"):
            op.foreach_batch(spark.range(1).selectExpr("cast(id as string) as key"), 0)
    finally:
        op.close()
    seen: Counter[str] = Counter()
    want: Counter[tuple[str, int]] = Counter()
    for i in range(3):
        for k, n in Counter(_keys(i)).items():
            seen[k] += n
            want[(k, seen[k])] += 1
    got = Counter(tuple(r) for r in spark.read.parquet(str(tmp_path / "out")).collect())
    assert got == want
    # the state, read through the server without registering the source
    state = spark.read.format("dstl").load(str(tmp_path / "state"))
    assert state.count() == len(seen)
